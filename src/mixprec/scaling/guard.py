"""The non-finite guard: what the loss scaler's inf check does for fp16, for every other precision.

In fp16 a non-finite gradient is caught by the scaler, which skips the step. In bf16 and fp32 nothing would
catch it: one inf or NaN reaches the optimizer and every parameter becomes NaN while the run "completes".
``NonFiniteGuard`` has the scaler's interface and records (so one loop, one log and one consecutive-skip
breaker serve every precision) but never scales: ``scale`` returns the loss untouched, ``step`` checks the
gradients and skips the update if any is non-finite, ``update`` records the step.

Cost per step: one read of every gradient on the device (``torch._foreach_norm``: no write) and one host
sync to read its verdict (free on a CPU; on a GPU the same one sync fp16's scaler makes).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling.scaler import GradScaler
from mixprec.shards import local


class NonFiniteGuard(GradScaler):
    """A pass-through scaler (``is_enabled()`` is False, the scale is 1) that skips non-finite steps.

    Args: ``max_consecutive_skips`` (``None`` never raises), ``history_size`` as :class:`GradScaler`; other
    scaler knobs are accepted and ignored, since nothing is scaled.
    """

    def __init__(
        self, *args: Any, max_consecutive_skips: int | None = 100, history_size: int = 1000, **_ignored: Any
    ) -> None:
        super().__init__(enabled=False, max_consecutive_skips=max_consecutive_skips, history_size=history_size)
        self._skipped_now: list[torch.optim.Optimizer] = []

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless a gradient of its parameters is inf/NaN. One host sync."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        bad = False
        if grads:
            with torch.no_grad():
                norms = torch._foreach_norm([local(g) for g in grads])
                flag = (~torch.stack([n.float().to(grads[0].device) for n in norms]).isfinite().all()).float()
                if self._found_inf_reducer is not None:  # sharded gradients: every process skips together
                    self._found_inf_reducer(flag)
                bad = bool(flag)
        if bad:
            self._skipped_now.append(optimizer)
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Record the step (skipped or not); raise after ``max_consecutive_skips`` skipped steps in a row."""
        skipped = bool(self._skipped_now)
        self.record.add(1.0, skipped, 1.0)
        optimizers, self._skipped_now = self._skipped_now, []
        self.record.raise_if_too_many_skips(
            skipped,
            self.max_consecutive_skips,
            lambda: [n for opt in optimizers for n in self.nonfinite_grad_names(opt)],
            "no loss scaling in this precision",
            "Check the inputs and the learning rate, or run `mixprec diagnose`.",
        )

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite_guard": True, "record": self.record.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The step record (from a guard's or a scaler's state: a run resumed in another precision)."""
        if "record" in state_dict:
            self.record.load_state_dict(state_dict["record"])
