"""Skip attribution: on a skipped step, which module's values became non-finite first, forward or backward.

The scaler knows *which parameters* hold inf/NaN gradients, but after a forward overflow that is every
parameter downstream of it: the answer to "why did my loss scale drop" is the module where the first inf
appeared. Finding it takes the order of events, so on a skipped step the watch replays the step's batch
through the diagnosis's non-finite search (:func:`mixprec.diagnostics.nonfinite.find_first_nonfinite`): forward
under the run's precision with a finiteness flag per module output, then backward of the loss times the loss
scale that step used, flags in backward's time order.

The replay is exact where it matters: a skipped step did not change the parameters, the batch is the one
the step used (kept by reference, never copied), the random state is the one its forward started from
(dropout draws the same masks), and the replay runs inside the diagnosis's model guard, so the training
run's random stream, buffers (BatchNorm statistics) and ``.grad`` are left as they were.

Cost: nothing on a step that is not skipped beyond keeping the batch and a copy of the RNG state (a few KB);
one forward and backward on a skipped step. Not under several processes (the replay would run the model
outside its DDP wrapper's collective schedule), nor for positional batches or a model that returns no loss:
there the attribution falls back to the modules owning the non-finite gradients, without an order.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._guard import ModelGuard
from mixprec.diagnostics.hooks import display_name
from mixprec.diagnostics.nonfinite import find_first_nonfinite


@dataclass(frozen=True)
class SkipAttribution:
    """Where a skipped step's non-finite values came from."""

    step: int
    loss_scale: float
    module: str | None
    """The first module whose output (forward) or gradient (backward) was non-finite; None if unknown."""
    phase: str | None
    """"forward" (the module's output overflowed: a matter of the format's range, not the loss scale) or
    "backward" (a gradient overflowed: usually the loss scale, which the scaler lowers)."""
    what: str | None = None
    """"output", "output grad" or "param grad <name>"."""
    dtype: str | None = None
    method: str = "replay"
    """"replay" (ordered, exact) or "gradients" (the modules owning non-finite .grad, unordered)."""
    modules: list[str] = field(default_factory=list)
    """For "gradients": every module owning a non-finite gradient."""

    def message(self) -> str:
        """The line the ``mixprec.watch`` logger prints for this skipped step."""
        if self.module is None:
            where = f"modules with non-finite gradients: {', '.join(self.modules) or 'none found'}"
        else:
            where = f"first non-finite: {self.module} ({self.phase}, {self.what}, {self.dtype})"
        return f"precision watch: step {self.step} skipped (loss scale {self.loss_scale:g}); {where}"

    def to_dict(self) -> dict[str, Any]:
        """The record written to ``metrics.jsonl`` and the run's summary."""
        return asdict(self)


class _Autocast:
    """The precision the replay runs under: none of its own, since a prepared model's forward already enters
    the run's autocast (and a fallen-back module leaves it), exactly as in training."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class StepRecorder:
    """Keeps each micro-batch of the current step (by reference) and the RNG state its forward started from."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batches: list[dict[str, Any] | None] = []
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def new_step(self) -> None:
        self.batches = []
        self.rng = None

    def record(self, args: tuple, kwargs: dict) -> None:
        if self.rng is None:
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            self.rng = (torch.get_rng_state(), cuda)
        # the non-finite search calls model(**batch): keyword batches only (the Trainer's and HF's convention)
        self.batches.append(dict(kwargs) if not args and kwargs else None)


def attribute_skip(
    model: nn.Module,
    recorder: StepRecorder,
    step: int,
    loss_scale: float,
    optimizer_grads: list[tuple[str, torch.Tensor | None]],
    can_replay: bool,
) -> SkipAttribution:
    """Replay the skipped step to find the first non-finite module; without a replay, name the modules that
    own non-finite gradients (``optimizer_grads``: (parameter name, grad) pairs). Forces host syncs: a few on
    the replay, one for the gradient check."""
    batches = recorder.batches
    if can_replay and batches and all(b is not None for b in batches):
        with ModelGuard(model, recorder.device):
            if recorder.rng is not None:
                cpu, cuda = recorder.rng
                torch.set_rng_state(cpu)
                if cuda is not None:
                    torch.cuda.set_rng_state(cuda, recorder.device)
            try:
                event, _ = find_first_nonfinite(model, batches, _Autocast(), loss_scale)  # type: ignore[arg-type]
            except ValueError:  # the model returns no loss: the replay cannot run backward
                event = None
            else:
                if event is not None:
                    return SkipAttribution(step, loss_scale, event.module, event.phase, event.what, event.dtype)
    return SkipAttribution(step, loss_scale, None, None, method="gradients", modules=_owners(optimizer_grads))


def _owners(named_grads: list[tuple[str, torch.Tensor | None]]) -> list[str]:
    present = [(n, g) for n, g in named_grads if g is not None]
    if not present:
        return []
    with torch.no_grad():
        bad = torch.stack([~torch.isfinite(g).all() for _, g in present]).tolist()
    owners: list[str] = []
    for (name, _), b in zip(present, bad):
        owner = display_name(name.rpartition(".")[0])
        if b and owner not in owners:
            owners.append(owner)
    return owners
