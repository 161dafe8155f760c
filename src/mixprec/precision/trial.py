"""One trial of the training step under a candidate precision, leaving no trace.

The race behind "auto" runs the user's forward and backward several times on the first batch before the
first real step. For that to cost nothing but time, each trial puts back what it touched: the gradients
(``None`` before the first step, or the sums of an accumulation window), the module buffers a forward may
update (BatchNorm statistics), and the random generators a forward draws from (dropout). The real step that
follows is then bit-identical to one run in the chosen mode from the start. Memory: one trial's graph at a
time, freed before the next, plus a copy of the buffers and of any gradients already present.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.race import Unfinished
from mixprec.shards import local

if TYPE_CHECKING:
    from mixprec.precision.base import Precision


class TrialState:
    """Gradients, buffers and RNG states of ``models`` at construction, restorable any number of times."""

    def __init__(self, models: Sequence[torch.nn.Module], device: torch.device) -> None:
        unique = {id(p): p for model in models for p in model.parameters() if p.requires_grad}  # shared: once
        self.params = list(unique.values())
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.buffers = [(b, b.detach().clone()) for model in models for b in model.buffers()]
        self.device = device
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self.grads):
                p.grad = None if g is None else g.clone()
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)

    def grads_finite(self) -> bool:
        """Whether every gradient is finite. One host sync."""
        flags = [torch.isfinite(local(p.grad)).all() for p in self.params if p.grad is not None]
        return bool(torch.stack(flags).all()) if flags else True


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so the host clock measures it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def race_clock(device: torch.device) -> tuple[Callable[[], float], str]:
    """The clock the race times trials with, and its name. On a CPU the calling thread's CPU time: it stops
    while the thread waits for a core, so a busy neighbour is not counted against whichever mode ran (issue
    29: wall-clock races beside one busy process gave bf16 0.85x-2.17x); torch's CPU backward runs on
    this thread, and the intra-op workers' share shows as this thread's wait at their barrier (spinning
    counts, a descheduled worker's sleep does not). On a GPU the wall clock after a device sync: the GPU's
    work never shows in host CPU time."""
    if device.type == "cpu":
        return time.thread_time, "thread CPU time"
    return time.perf_counter, "wall clock"


class _PastDeadline(Exception):
    """Raised by the forward pre-hook of a trial that ran out of time."""


def run_trial(
    precision: Precision,
    loss_fn: Callable[[], torch.Tensor],
    state: TrialState,
    select: Callable[[Precision], contextlib.AbstractContextManager[None]],
    loss_scale: float = 1.0,
    deadline: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> bool | Unfinished:
    """Forward (under ``select(precision)``, which makes the prepared model run in that mode) and backward
    of ``loss_fn``'s loss times ``loss_scale``, then restore ``state``. Returns whether the loss and the
    gradients were finite, or :class:`Unfinished` (with how many checkpoints it passed: module calls, then
    saved-tensor reads in backward) when ``clock()`` passed ``deadline`` first: the trial is stopped at the
    next checkpoint (so a mode 15x slower costs little to rule out, and one paying one-time setup shows it
    got further on its next try). Leaves the device idle. Call with a deadline only in a single process:
    stopping one process mid-forward would leave the others waiting in a collective."""
    handles = []
    watch: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    passed = [0]
    if deadline is not None:

        def check(*_: Any) -> None:
            if clock() > deadline:
                raise _PastDeadline
            passed[0] += 1

        def unpack(saved: torch.Tensor) -> torch.Tensor:
            check()
            return saved

        # Checked before each module's forward, and in backward each time autograd reads a saved tensor (a
        # mode can be slow in either; module backward hooks would change how modules treat their outputs).
        handles.append(torch.nn.modules.module.register_module_forward_pre_hook(check))
        watch = torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack)
    try:
        with select(precision), watch:
            loss = loss_fn()
            if deadline is not None and clock() > deadline:
                raise _PastDeadline
            finite_loss = torch.isfinite(loss.detach()).all()
            (loss.float() * loss_scale).backward()
        finite = bool(finite_loss) and state.grads_finite()
        synchronize(state.device)
        return finite
    except _PastDeadline:
        synchronize(state.device)
        return Unfinished(passed[0])
    finally:
        for handle in handles:
            handle.remove()
        state.restore()


@contextlib.contextmanager
def no_trace(models: Sequence[torch.nn.Module], device: torch.device) -> Iterator[TrialState]:
    """Snapshot ``models``' trainable state; restore it when the block ends, however it ends."""
    state = TrialState(models, device)
    try:
        yield state
    finally:
        state.restore()
