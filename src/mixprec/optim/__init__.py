"""Optimizers for parameters or optimizer states kept in low precision ("bf16-pure", HF's adamw_anyprecision)."""

from mixprec.optim.anyprecision import AnyPrecisionAdamW
from mixprec.optim.bf16_adamw import Bf16AdamW
from mixprec.optim.rounding import stochastic_round_

__all__ = ["AnyPrecisionAdamW", "Bf16AdamW", "stochastic_round_"]
