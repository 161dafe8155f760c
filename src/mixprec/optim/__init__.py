"""Optimizers for parameters kept in low precision (the "bf16-pure" mode)."""

from mixprec.optim.bf16_adamw import Bf16AdamW, stochastic_round_

__all__ = ["Bf16AdamW", "stochastic_round_"]
