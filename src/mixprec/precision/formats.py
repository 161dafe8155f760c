"""The number formats a precision computes in, described by their range and precision.

A :class:`~mixprec.precision.base.Precision` answers its ``compute_format`` from here, so the diagnosis and the
watch measure a run against the format it runs in (issue 34: a lookup by the mode's *name* gave every bf16
policy and pure bf16 fp16's range). Every threshold except the maxima is a power of two, which is why the
diagnosis's histograms bin by binary exponent: "how many values would fp16 flush to zero at loss scale 2^k"
is then an exact count read off a histogram, for every k, without a second pass over the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """One IEEE-style binary format, described by what the diagnosis needs to know about it."""

    name: str
    """Short name ("fp16", "bf16", "fp32")."""
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
# fp32: 8 exponent bits, 23 mantissa bits: max ~3.40e38, min normal 2^-126, min subnormal 2^-149.
FP32 = FloatFormat(
    "fp32",
    torch.float32,
    min_subnormal_exp=-149,
    min_normal_exp=-126,
    max=float(torch.finfo(torch.float32).max),
    mantissa_bits=23,
)
FORMATS: dict[str, FloatFormat] = {f.name: f for f in (FP16, BF16)}
"""The low-precision formats a diagnosis judges, in the order a recommendation tries them."""
_BY_DTYPE: dict[torch.dtype, FloatFormat] = {f.dtype: f for f in (FP16, BF16, FP32)}
_BY_NAME: dict[str, FloatFormat] = {f.name: f for f in (FP16, BF16, FP32)}


def format_of(dtype: torch.dtype) -> FloatFormat:
    """The format of ``dtype``; a ValueError for a dtype no precision here computes in (no silent default)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in _BY_DTYPE)
        raise ValueError(f"no number format is described for {dtype} (described: {known})") from None


def format_named(name: str) -> FloatFormat:
    """The format ``name`` names ("fp16", "bf16", "fp32": a watch's setting, a diagnosis's verdict); a ValueError
    listing the formats for any other name (the one parse of a format's name)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown number format {name!r}; choose one of: {', '.join(_BY_NAME)}") from None


def loss_scale_for(fmt: FloatFormat, scale_exp: int) -> float:
    """The loss scale a run in ``fmt`` uses: ``2 ** scale_exp`` where the format scales the loss, else 1."""
    return float(2**scale_exp) if fmt.loss_scaled else 1.0
