"""AdamW for bf16 parameters whose small updates are not lost: stochastic rounding or Kahan summation.

A bf16 parameter has 8 bits of mantissa: an update smaller than half a unit in the last place (|w| x 2^-9)
rounds back to the same value, so late in training, with small learning rates, round-to-nearest silently
stops learning (Zamirai et al. 2020, "Revisiting BFloat16 Training"). Two remedies, both keeping 2 bytes per
parameter and per Adam moment:

- ``rounding="stochastic"``: round the fp32 result up or down with probability proportional to the distance,
  so updates are unbiased in expectation (Gupta et al. 2015). The random bits come from torch's generator of
  the parameter's device, so checkpointed RNG states make a resumed run exact.
- ``rounding="kahan"``: keep the rounding error of each update in a bf16 compensation buffer and add it back
  next step (Kahan summation; +2 bytes per parameter).
- ``rounding="nearest"``: plain bf16, for comparison: what loses the small updates.

The step is adamw_step.py's, shared with AnyPrecisionAdamW; moments stay in the parameter's dtype (bf16).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mixprec.optim.adamw_step import ROUNDINGS, AdamWStep, StepRule


class Bf16AdamW(AdamWStep):
    """Adam / AdamW over bf16 (or any low-precision) parameters with fp32 arithmetic and a rounding rule.

    Args as ``torch.optim.AdamW`` (``decoupled=False`` gives ``torch.optim.Adam``'s L2 weight decay), plus
    ``rounding`` ("stochastic", "kahan" or "nearest") and ``bucket_elements`` (fp32 scratch per bucket; default
    by device: 2^22 on a GPU, 2^18 elsewhere). Parameters may also be fp32, in which case the rule is
    irrelevant and the update is AdamW's. Cost: :class:`~mixprec.optim.adamw_step.AdamWStep`'s.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
        rounding: str = "stochastic",
        bucket_elements: int | None = None,
    ) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"Bf16AdamW(rounding={rounding!r}): choose one of {', '.join(ROUNDINGS)}")
        if not 0.0 <= lr:
            raise ValueError(f"Bf16AdamW(lr={lr!r}): lr must be >= 0")
        if bucket_elements is not None and bucket_elements < 1:
            raise ValueError(f"Bf16AdamW(bucket_elements={bucket_elements!r}): must be >= 1 (or None: by device)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled": decoupled,
            "rounding": rounding,
        }
        super().__init__(params, defaults, bucket_elements)

    def rule(self, group: dict[str, Any]) -> StepRule:
        """Moments and compensation in the parameter's dtype; the group's decay kind and rounding."""
        return StepRule(decoupled=group["decoupled"], rounding=group["rounding"])
