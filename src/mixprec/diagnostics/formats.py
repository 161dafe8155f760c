"""The ranges of the low-precision formats the diagnosis measures gradients and activations against.

Every threshold except the two maxima is a power of two, which is why the histograms bin by binary exponent:
"how many values would fp16 flush to zero at loss scale 2^k" is then an exact count read off a histogram,
for every k, without a second pass over the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """One IEEE-style binary format, described by what the diagnosis needs to know about it."""

    name: str
    """Canonical precision name ("fp16", "bf16")."""
    dtype: torch.dtype
    """The torch dtype."""
    min_subnormal_exp: int
    """log2 of the smallest positive subnormal; nonzero values below 2^this are counted as flushed to 0."""
    min_normal_exp: int
    """log2 of the smallest positive normal; values in [2^min_subnormal_exp, 2^this) keep fewer bits."""
    max: float
    """Largest finite value; activations above it are counted as overflow."""
    mantissa_bits: int
    """Explicit mantissa (fraction) bits: the ULP of a value in [2^e, 2^(e+1)) is 2^(e - mantissa_bits)."""
    loss_scaled: bool = False
    """Whether training in this format scales the loss (fp16: its narrow exponent range); its gradients are
    then judged at the recommended loss scale, the others' at scale 1."""


# fp16: 5 exponent bits, 10 mantissa bits (the seed's slide 2): max 65504, min normal 2^-14, min subnormal 2^-24.
FP16 = FloatFormat(
    "fp16", torch.float16, min_subnormal_exp=-24, min_normal_exp=-14, max=65504.0, mantissa_bits=10, loss_scaled=True
)
# bf16: fp32's 8 exponent bits, 7 mantissa bits: max (2 - 2^-7) * 2^127 ~ 3.39e38, min normal 2^-126,
# min subnormal 2^-133.
BF16 = FloatFormat(
    "bf16",
    torch.bfloat16,
    min_subnormal_exp=-133,
    min_normal_exp=-126,
    max=float(torch.finfo(torch.bfloat16).max),
    mantissa_bits=7,
)
FORMATS: dict[str, FloatFormat] = {f.name: f for f in (FP16, BF16)}
"""The formats judged, in the order a recommendation tries them."""


def loss_scale_for(name: str, scale_exp: int) -> float:
    """The loss scale a run in format ``name`` uses: 2^``scale_exp`` where the format scales the loss, else 1
    (bf16, and fp32, which is no format here)."""
    fmt = FORMATS.get(name)
    return float(2**scale_exp) if fmt is not None and fmt.loss_scaled else 1.0
