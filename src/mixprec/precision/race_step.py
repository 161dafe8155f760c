"""A step of auto's in-run race (inrun.py) as a transaction (issue 34).

The in-run race's trials are real training steps, each in one candidate mode. One that fails must leave the
run as the chosen mode would have: a step whose loss or gradients are non-finite is a skipped batch (the
scaler skipped the update: weights, moments and optimizer step counts are untouched, the prepared LR
scheduler holds still), and the chosen mode's step record counts it as one (:func:`carry_record`: its
skipped-step and consecutive-skip counters, which the summary and the breaker read). A step whose candidate
raises is undone (:class:`StepSnapshot`): weights, gradients, optimizer state, every candidate's scaler and
the RNG are put back as they were when the step began, the mode leaves the race, and the error goes on to
the caller. A scaled mode's first step starts at a loss scale measured on the gradients of the unscaled modes'
steps before it (:func:`measured_scale`), not at its scaler's 2^16: a routine overflow there would cost the
run a batch. Costs one copy of the parameters, their gradients and the optimizer state per race step, taken
before the race's clock starts (so no mode is charged for it), and nothing once the race has decided.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.formats import FP16
from mixprec.precision.inrun import InRunRace
from mixprec.precision.race import Failed, Unfinished
from mixprec.scaling.record import ScaleRecord

if TYPE_CHECKING:
    from mixprec.precision.base import Precision

SCALE_BACKOFF = 2.0**-8  # an fp16 trial that overflows retries at 1/256 of the scale, down to 1
SCALE_HEADROOM = 8.0  # fp16's first scale keeps the gradients this far below its max (mixprec.diagnostics' default)


def measured_scale(max_grad: float, start: float) -> float:
    """The loss scale an fp16 trial starts at after the other modes' steps saw gradients up to ``max_grad``:
    the largest 2^k <= ``start`` with ``max_grad * 2^k * SCALE_HEADROOM <= 65504`` (at least 1); ``start``
    when nothing finite was seen."""
    if not (max_grad > 0 and math.isfinite(max_grad)):
        return start
    k = math.floor(math.log2(FP16.max / (SCALE_HEADROOM * max_grad)))
    return max(1.0, min(start, 2.0**k))


RaceStep = tuple[str, float, bool]
"""One race step as its mode's scaler recorded it: the mode, the loss scale it ran with, whether it skipped."""


def _clone(value: Any) -> Any:
    # a copy by _to_copy, not clone(): torchao's 8/4-bit optimizer states implement the one and not the other
    return value.detach().to(value.device, copy=True) if isinstance(value, torch.Tensor) else value


class StepSnapshot:
    """What a race step may change, as it was when the step began; :meth:`restore` puts it back."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizers: Iterable[torch.optim.Optimizer],
        candidates: Sequence[Precision],
        device: torch.device,
    ) -> None:
        unique = {id(p): p for p in params}
        self.params = [
            (p, p.detach().clone(), None if p.grad is None else p.grad.detach().clone()) for p in unique.values()
        ]
        self.optimizers = [
            (
                opt,
                {p: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()},
                [{k: _clone(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            )
            for opt in optimizers
        ]
        self.scalers = [(p.scaler, p.scaler.state_dict()) for p in candidates]
        self.device = device
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for p, value, grad in self.params:
                p.copy_(value)
                p.grad = None if grad is None else grad.clone()
        for opt, state, groups in self.optimizers:
            opt.state.clear()
            opt.state.update({p: {k: _clone(v) for k, v in s.items()} for p, s in state.items()})
            for group, saved in zip(opt.param_groups, groups):
                group.update({k: _clone(v) for k, v in saved.items()})
        for scaler, saved in self.scalers:
            scaler.load_state_dict(saved)  # the guard's state is its step record alone
            if scaler.is_enabled():
                scaler.update(new_scale=scaler.get_scale())  # back to READY: no unscale or step half done
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _max_abs_grad(params: Iterable[torch.nn.Parameter]) -> float:
    """The largest finite |gradient| of ``params`` (one host sync; race steps of unscaled modes only)."""
    grads = [p.grad.detach().abs().max() for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return 0.0
    top = torch.stack([g.float() for g in grads]).max()
    return float(top) if torch.isfinite(top) else 0.0


class Optimizers:
    """The optimizers a precision converted (weakly held: a Trainer's are rebuilt by ``model_init``)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[torch.optim.Optimizer]] = []

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        self._refs.append(weakref.ref(optimizer))

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return (opt for ref in self._refs if (opt := ref()) is not None)


def carry_record(record: ScaleRecord, before: dict[str, Any], steps: Sequence[RaceStep], chosen: Precision) -> None:
    """Rewrite ``record`` (the chosen mode's) as if the chosen mode had taken every race step: ``before`` (the
    record the run had when the race began) followed by one entry per step, skipped where the step was. A
    step another mode ran is entered at the chosen mode's own scale (1 where it does not scale)."""
    own = record.scale
    carried = ScaleRecord(history_size=record.history_size)
    carried.load_state_dict(before)
    for name, scale, skipped in steps:
        used = scale if name == chosen.name else own
        carried.add(used, skipped, used)
    carried.scale = own
    record.load_state_dict(carried.state_dict())


class RaceSteps:
    """auto's in-run race (:class:`~mixprec.precision.inrun.InRunRace`) driven a training step at a time, each
    step a transaction: :meth:`begin` snapshots and names the step's mode, :meth:`end` hands the race its
    outcome, :meth:`abort` undoes a step whose mode raised. ``finish`` gets the race's decision and returns
    the mode it chose, whose step record then counts the race's steps (:func:`carry_record`)."""

    def __init__(
        self,
        race: InRunRace,
        candidates: Sequence[Precision],
        params: Callable[[], Iterable[torch.nn.Parameter]],
        optimizers: Optimizers,
        finish: Callable[[Any], Precision],
    ) -> None:
        self._race = race
        self._candidates = list(candidates)
        self._params = params
        self._optimizers = optimizers
        self._finish = finish
        self._snapshot: StepSnapshot | None = None
        self._backoffs = 0  # steps an fp16 candidate skipped at a scale it then backed off from
        self._max_grad = 0.0  # the largest finite gradient the unscaled modes' steps left (fp16's first scale)
        self._steps: list[RaceStep] = []
        self._before = self._candidates[0].scaler.record.state_dict()  # the run's record as the race begins

    @property
    def in_step(self) -> bool:
        return self._race.in_step

    @property
    def steps(self) -> int:
        return self._race.steps

    def begin(self) -> Precision:
        """The mode the training step starting now runs in. The snapshot is taken before the step's clock
        starts: no mode is charged for it."""
        self._snapshot = StepSnapshot(self._params(), self._optimizers, self._candidates, self._race.device)
        name = self._race.begin()
        mode = next(p for p in self._candidates if p.name == name)
        if mode.needs_loss_scaling and all(step[0] != name for step in self._steps):
            mode.scaler.update(new_scale=measured_scale(self._max_grad, mode.scaler.get_scale()))
        return mode

    def end(self, ran: Precision) -> None:
        """``ran``'s optimizer step is done (applied, or skipped as non-finite: a skipped batch)."""
        self._snapshot = None
        record = ran.scaler.record
        if record.history:
            entry = record.history[-1]
            self._steps.append((ran.name, entry.scale, entry.skipped))
        outcome: bool | Unfinished = not ran.step_was_skipped
        self.note_gradients(ran)  # a loop that never clips: the gradients as the step left them
        scale = ran.scaler.get_scale() if ran.needs_loss_scaling else 1.0
        if not outcome and scale > 1.0:
            # an fp16 overflow at a large scale: back off as the aside race does, and let the step not count
            # (progress: each one gets further), so a mode non-finite even unscaled is excluded within 3 steps
            ran.scaler.update(new_scale=max(scale * SCALE_BACKOFF, 1.0))
            self._backoffs += 1
            outcome = Unfinished(self._backoffs)
        # every candidate's record counts the race's steps so far, whichever mode is current when the run's
        # step count, its skipped steps or the watch read it (an undecided race: a short run ends in one)
        for candidate in self._candidates:
            carry_record(candidate.scaler.record, self._before, self._steps, candidate)
        self._send(outcome)

    def note_gradients(self, ran: Precision) -> None:
        """``ran``'s step has its true gradients now (unscaled, not yet clipped: the precision's unscale hook,
        which clipping calls first): an unscaled mode's largest finite one sets fp16's first scale. One host
        sync, in race steps of unscaled modes only."""
        if not ran.needs_loss_scaling:
            self._max_grad = max(self._max_grad, _max_abs_grad(self._params()))

    def abort(self, failed: Precision, err: Exception) -> None:
        """``failed`` raised ``err`` during the step: put back the state the step began from; the mode leaves
        the race."""
        if self._snapshot is not None:
            self._snapshot.restore()
            self._snapshot = None
        self._send(Failed(f"its training step raised {type(err).__name__}: {err}"))

    def _send(self, outcome: bool | Unfinished | Failed) -> None:
        self._race.end(outcome)
        if self._race.done:
            chosen = self._finish(self._race.result)
            carry_record(chosen.scaler.record, self._before, self._steps, chosen)
