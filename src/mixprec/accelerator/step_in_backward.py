"""The optimizer step inside backward: each parameter is updated as soon as its gradient is complete, and the
gradient freed at once, so a step never holds the whole model's gradients (torch's "optimizer step in
backward" pattern, torchtitan's ``early_step_in_backward``, HF's layer-wise optimizers).

With bf16-pure and 8-bit Adam states that is 2 bytes per parameter of weights plus about 2 of states, instead
of 6 with every gradient alive at the end of backward. The price: nothing can look at all the gradients
before the first update, so global-norm clipping, gradient accumulation, fp16's loss scaling (a skipped step
must skip every parameter) and several processes (gradients are averaged after backward) are refused where
they are asked for, never silently dropped.

Each hook steps the optimizer on a one-parameter view of its group (a copy of the group's hyperparameters,
as the LR scheduler left them, with ``params=[p]``), through the precision strategy's ``parameter_step``:
the optimizer's state (``optimizer.state[p]``), its ``state_dict`` and checkpoints are the ordinary ones, and
``optimizer.step()`` after backward only records the step (``end_step``).

Non-finite gradients: each gradient is checked before it is applied (one host sync per parameter: free on a
CPU, a cost on a GPU) and a non-finite one is never applied; the step is recorded as skipped, with the same
consecutive-skip breaker as every precision. Parameters whose gradients were finite and came earlier in the
same backward keep their update: a step in backward cannot be undone (when the loss itself is inf or NaN,
every gradient is, and nothing is applied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.master_weights import MasterWeightsOptimizer

if TYPE_CHECKING:
    from mixprec.precision.base import Precision

REFUSALS = {
    "clip": (
        "gradient clipping needs every gradient before the first update, and step_in_backward=True updates each "
        "parameter during backward; turn clipping off (TrainingArguments(max_grad_norm=0)) or step_in_backward off"
    ),
    "accumulate": (
        "gradient accumulation needs the summed gradients to outlive backward, and step_in_backward=True frees "
        "each one at once; use gradient_accumulation_steps=1 or step_in_backward=False"
    ),
    "fp16": (
        "fp16's loss scaling skips a step when any gradient overflowed, which is known only after the whole "
        "backward; use bf16, bf16-pure or fp32 with step_in_backward=True"
    ),
    "masters": (
        "its fp32 master copy is stepped after backward, not during it; cast the trainable parameters to float32 "
        "before prepare (e.g. peft's get_peft_model(..., autocast_adapter_dtype=True)), use precision='bf16-pure', "
        "or step_in_backward=False"
    ),
    "processes": (
        "with several processes gradients are averaged across them after backward; step_in_backward=True runs "
        "in one process"
    ),
}


LEFT_OUT = "step_in_backward=True: its loss scaling needs every gradient before the first update"
"""Why "auto" races without fp16 (and fp16 policies) in a run that steps in backward."""


def fit_for_step_in_backward(precision: Precision) -> bool:
    """Whether ``precision`` can update each parameter during backward: not a mode that scales the loss (fp16's
    unscale and inf check need every gradient before any step); "auto" first leaves such candidates out of its
    race (``LEFT_OUT`` in its decision) and then can."""
    precision.leave_out(lambda p: p.needs_loss_scaling, LEFT_OUT)
    return not precision.may_scale_loss


def refuse_step_in_backward(precision: Precision, processes: int) -> None:
    """``Accelerator(step_in_backward=True)`` refused where it cannot run: a precision that scales the loss,
    several processes."""
    if not fit_for_step_in_backward(precision):
        raise ValueError(f"Accelerator(mixed_precision={precision.name!r}, step_in_backward=True): {REFUSALS['fp16']}")
    if processes > 1:
        raise ValueError(f"Accelerator(step_in_backward=True): {REFUSALS['processes']}")


class BackwardStepper:
    """Hooks that step ``optimizer`` for each of its parameters when that parameter's gradient is ready."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, precision: Precision, fence: Callable[[], None] | None = None
    ) -> None:
        if isinstance(optimizer, MasterWeightsOptimizer):  # its masters' gradients are copied after backward
            raise ValueError(
                f"Accelerator(step_in_backward=True): parameter {optimizer.first_name()!r} is "
                f"{optimizer.first_dtype()} and trainable; {REFUSALS['masters']}"
            )
        self.optimizer = optimizer
        self.precision = precision
        self.fence = fence  # an asynchronous save still copying the weights: the first update waits for it
        self._group_of: dict[int, int] = {}  # a parameter's group, by index: load_state_dict makes new group dicts
        self._handles: list[Any] = []
        self.install()

    def install(self) -> None:
        """Hook every trainable parameter of the optimizer (again, after ``add_param_group``)."""
        self.remove()
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._group_of[id(p)] = index
                    self._handles.append(p.register_post_accumulate_grad_hook(self._step))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._group_of.clear()

    def _step(self, param: torch.Tensor) -> None:
        if self.precision.in_trial:  # auto's race trial: its gradients are read and put back, nothing steps
            return
        if self.fence is not None:
            self.fence()
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [{**groups[self._group_of[id(param)]], "params": [param]}]
        try:
            self.precision.parameter_step(self.optimizer)
        finally:
            self.optimizer.param_groups = groups
        param.grad = None
