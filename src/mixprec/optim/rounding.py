"""Stochastic rounding of fp32 values to bf16: the rule Bf16AdamW(rounding="stochastic") applies to each update.

Round-to-nearest loses an update smaller than half a unit in the last place of the weight; rounding up or down
with probability proportional to the distance keeps it in expectation (Gupta et al. 2015). The random bits come
from noise.py (a hashed counter keyed from torch's generator of the device).
"""

from __future__ import annotations

import torch

from mixprec.optim.noise import RoundingNoise

_HIGH_MASK = -65536  # 0xFFFF0000 as int32: keeps sign, exponent and the 7 mantissa bits bf16 holds


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write fp32 ``src`` into bf16 ``dst`` with stochastic rounding: the 16 bits bf16 drops are replaced
    by a random carry (probability = dropped bits / 2^16). Exact bf16 values pass unchanged."""
    work = src.to(torch.float32, copy=True).contiguous()
    source = RoundingNoise(work.device)
    source.reseed()
    round_stochastically_(work, source.bits(work.numel()).view(work.shape))
    dst.copy_(work)  # exact: the low 16 bits are zero


def round_stochastically_(w: torch.Tensor, noise: torch.Tensor) -> None:
    """fp32 ``w`` in place to bf16-representable values: 16 random bits added below bf16's mantissa, then cut.
    Integer addition on the bit pattern rounds the magnitude up, for negative numbers too; a carry out of the
    mantissa bumps the exponent, which is the correctly rounded value."""
    w.view(torch.int32).add_(noise).bitwise_and_(_HIGH_MASK)
