"""AdamW with its moments in any dtype, and optional Kahan summation: HF's ``optim="adamw_anyprecision"``.

HF's Trainer builds this from torchdistx's ``AnyPrecisionAdamW``, which no longer installs with current torch;
this is the same algorithm and the same options (names and defaults as HF passes them):

- ``momentum_dtype`` / ``variance_dtype``: storage of the two Adam moments. bfloat16 for both halves the
  optimizer state (8 -> 4 bytes per parameter) on fp32 master weights.
- ``use_kahan_summation``: for parameters held in bf16/fp16 (as with ``precision="bf16-pure"``), keep what
  each update loses to rounding in a ``compensation_buffer_dtype`` buffer and add it back next step, so small
  updates are not lost (Zamirai et al. 2020). fp32 parameters have nothing to compensate at this scale and
  get no buffer.

The step is adamw_step.py's, shared with Bf16AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mixprec.optim.adamw_step import AdamWStep, StepRule


class AnyPrecisionAdamW(AdamWStep):
    """AdamW (decoupled weight decay) with moments stored in ``momentum_dtype`` and ``variance_dtype``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        use_kahan_summation: bool = False,
        momentum_dtype: torch.dtype = torch.float32,
        variance_dtype: torch.dtype = torch.float32,
        compensation_buffer_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"AnyPrecisionAdamW(lr={lr!r}): must be >= 0")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "use_kahan_summation": use_kahan_summation,
            "momentum_dtype": momentum_dtype,
            "variance_dtype": variance_dtype,
            "compensation_buffer_dtype": compensation_buffer_dtype,
        }
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts every floating state to its parameter's dtype (fp32 moments after a resume
        would undo the saving): put the moments back in the dtypes their group asks for."""
        super().load_state_dict(state_dict)
        keys = {
            "exp_avg": "momentum_dtype",
            "exp_avg_sq": "variance_dtype",
            "compensation": "compensation_buffer_dtype",
        }
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                for key, dtype_key in keys.items():
                    if key in state:
                        state[key] = state[key].to(group[dtype_key])

    def rule(self, group: dict[str, Any]) -> StepRule:
        """AdamW's decay; moments in the group's dtypes; Kahan's buffer (low-precision parameters only) in
        ``compensation_buffer_dtype``, or round to nearest."""
        return StepRule(
            decoupled=True,
            rounding="kahan" if group["use_kahan_summation"] else "nearest",
            momentum_dtype=group["momentum_dtype"],
            variance_dtype=group["variance_dtype"],
            compensation_dtype=group["compensation_buffer_dtype"],
        )
