"""Where non-finite values start: the first module whose output or gradient is inf/NaN under a precision.

Flags are kept on the device in execution order (forward hooks fire when a module returns, innermost module
first; gradient hooks fire in backward's time order) and read back once per phase, so the search costs two
host syncs per batch, not one per module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.hooks import HookRegistry, display_name, param_owners
from mixprec.models.outputs import extract_loss
from mixprec.precision.base import Precision


@dataclass(frozen=True)
class NonfiniteEvent:
    """The first non-finite tensor seen."""

    module: str
    """Qualified name of the module (``"<model>"`` for the model itself)."""
    phase: str
    """"forward" (the module's output) or "backward" (the gradient of its output, or of its parameter)."""
    dtype: str
    """dtype of the tensor that held the inf/NaN, e.g. "float16"."""
    batch: int
    """Index of the batch (0-based) where it happened."""
    what: str = "output"
    """"output", "output grad", or "param grad <name>"."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Flags:
    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []
        self.meta: list[tuple[str, str, str]] = []

    def add(self, name: str, what: str, t: torch.Tensor) -> None:
        self.flags.append(~torch.isfinite(t).all())
        self.meta.append((display_name(name), what, str(t.dtype).removeprefix("torch.")))

    def first(self, phase: str, batch: int) -> NonfiniteEvent | None:
        """The first flagged entry. Forces one host sync."""
        if not self.flags:
            return None
        f = torch.stack(self.flags)
        idx = int(torch.argmax(f.to(torch.uint8)))  # argmax returns the first maximum
        if not bool(f[idx]):
            return None
        module, what, dtype = self.meta[idx]
        return NonfiniteEvent(module, phase, dtype, batch, what)


def find_first_nonfinite(
    model: nn.Module,
    batches: list[dict[str, Any]],
    precision: Precision,
    loss_scale: float = 1.0,
) -> tuple[NonfiniteEvent | None, list[float]]:
    """Run forward under ``precision.autocast()`` and backward of ``loss * loss_scale``, batch by batch, and
    return the first module whose output (forward) or output/parameter gradient (backward) held inf or NaN,
    with the losses seen. Stops at the first batch where one is found; backward is skipped when forward
    already failed. Gradients come from ``torch.autograd.grad``: ``.grad`` is not written.

    Host syncs: two per batch (one per phase) and one at the end. The caller restores the model's state.
    """
    owners = param_owners(model)
    params = [p for _, _, p in owners]
    losses: list[torch.Tensor] = []
    event = None
    for i, batch in enumerate(batches):
        event = _run_batch(model, batch, i, precision, loss_scale, owners, params, losses)
        if event is not None:
            break
    return event, torch.stack(losses).double().cpu().tolist() if losses else []


def _run_batch(model, batch, i, precision, loss_scale, owners, params, losses) -> NonfiniteEvent | None:
    fwd, bwd = _Flags(), _Flags()
    with HookRegistry() as hooks:
        hooks.hook_module_outputs(
            model,
            on_output=lambda n, t: fwd.add(n, "output", t),
            on_output_grad=lambda n, g, _: bwd.add(n, "output grad", g),
        )
        with precision.autocast():
            loss = extract_loss(model(**batch))
        losses.append(loss.detach().float())
        event = fwd.first("forward", i)
        if event is not None or not (loss.requires_grad and params):
            return event
        for owner, p_name, p in owners:
            hooks.add(p.register_hook(_param_hook(bwd, owner, p_name)))
        # backward outside autocast, as torch recommends; ops recorded in fp16 still run backward in fp16
        torch.autograd.grad(loss * loss_scale, params, allow_unused=True)
        return bwd.first("backward", i)


def _param_hook(flags: _Flags, owner: str, p_name: str):
    def hook(grad: torch.Tensor) -> None:
        with torch.no_grad():
            flags.add(owner, f"param grad {p_name}", grad)

    return hook
