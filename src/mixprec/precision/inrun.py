"""auto's race run as the training run's own first steps, not as trials aside from it (issue 23).

A race aside from training costs every trial it runs: on the main job ~25 forward+backward passes of the first
batch (2-3 s of a 27 s run), on GPT-2 124M on a CPU over a minute. Run as the run's first steps instead, each
trial is a real step of one candidate (forward, backward and optimizer update, in that mode: all candidates
keep fp32 weights and differ only in autocast, so any of them may take any step), and the race costs only
those steps' time over the chosen mode's. The protocol is the same generator (race.py's ``decide_steps``):
``begin`` tells which mode the step starting now runs in and starts the clock; ``end`` stops it when the
optimizer step is done, and sends the outcome. The price, first steps that mix the candidates, is paid back
by the Trainer's replay (auto.py); each step is a transaction (race_step.py).

A step cannot be stopped half-way, so a warm-up step over the race's time limit counts as stopped with no
progress: a mode that many times slower than the safest is dropped after ``MAX_STALLS + 1`` such steps (in one
process: under several, each process's clock would judge differently, and the trials must be the same for all).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.decision import AutoDecision
from mixprec.precision.race import EARLY_ROUNDS, MAX_WARMUP, MIN_ROUNDS, Failed, Outcome, Steps, Trial, Unfinished
from mixprec.precision.trial import synchronize

if TYPE_CHECKING:
    from mixprec.precision.base import Precision


def shortest_in_run(candidates: int) -> int:
    """The shortest run (optimizer steps) whose first steps may race ``candidates`` modes: twice the race's
    shortest course (a warm-up step and ``EARLY_ROUNDS`` rounds each), so it ends well inside the run. Issue
    36: a 60-step run raced aside paid 5.1 s of trials, 30% of the run; as its own steps it pays only their
    time over the winner's, bounded by the race's budget (race.py's ``BUDGET_SHARE``)."""
    return 2 * candidates * (1 + EARLY_ROUNDS)


def race_chosen(asked: bool | None) -> bool:
    """Whether the caller chose how to race (``asked``: in-run or not) or ``MIXPREC_AUTO_RACE`` did for every
    run: then neither a run's shortness nor its first evaluation overrides the choice."""
    return asked is not None or os.environ.get("MIXPREC_AUTO_RACE", "") in ("in-run", "aside")


def too_short_to_race(
    steps_left: int | None, candidates: Sequence[Precision], asked: bool | None = None
) -> AutoDecision | None:
    """The decision for a run too short for any race to pay: fewer optimizer steps than an in-run race needs
    (:func:`shortest_in_run`), where a race aside costs more passes (a warm-up and ``EARLY_ROUNDS`` rounds of
    every mode) than the fastest could save over the whole run: a 3-step GPT-2 run on a CPU raced for 12 s and
    trained for 10. The safest candidate, unraced, saying so; None for a longer or unknown run, one candidate,
    or a run whose caller chose how to race (``asked``, ``MIXPREC_AUTO_RACE``)."""
    shortest = shortest_in_run(len(candidates))
    if steps_left is None or steps_left >= shortest or len(candidates) < 2 or race_chosen(asked):
        return None
    safest = candidates[0]
    said = (
        f"auto on {safest.device.type} kept {safest.name}, the safest, without racing: this run's {steps_left} "
        f"steps are fewer than a race of {len(candidates)} modes needs to win back its cost ({shortest}); name "
        "a precision to run another"
    )
    return AutoDecision(safest.name, {}, device=safest.device.type, source="guess", measured=said)


def in_run_plan(
    steps_left: int | None,
    candidates: int,
    rounds: int,
    asked: bool | None = None,
    fp32_weights: bool = True,
    quiet: int | None = None,
) -> tuple[bool, int]:
    """Whether a run of ``steps_left`` optimizer steps (None: unknown) races as its own steps, and the rounds
    it may take: in-run from :func:`shortest_in_run` steps on (``asked``: the caller's choice instead), only
    where every candidate keeps fp32 weights (``fp32_weights``: any of them may take any step), its rounds
    capped so that the race takes at most a quarter of the run (warm-ups, at most ``MAX_WARMUP`` + 3 each,
    included). ``MIXPREC_AUTO_RACE=aside`` (or ``in-run``) chooses for every run the caller left open.

    ``quiet``: the steps before the run first evaluates or saves. A race the run has not asked for ends before
    then (a warm-up step and its rounds per candidate), so an evaluation measures, and a checkpoint holds, the
    chosen mode's run; where not even ``EARLY_ROUNDS`` rounds fit, it races aside."""
    chosen = race_chosen(asked)
    if asked is None:
        choice = os.environ.get("MIXPREC_AUTO_RACE", "")
        long_enough = steps_left is not None and steps_left >= shortest_in_run(candidates)
        asked = choice == "in-run" or (choice != "aside" and long_enough)
    in_run, aside_rounds = asked and fp32_weights, rounds
    if in_run and steps_left is not None:
        rounds = min(rounds, max(MIN_ROUNDS, steps_left // 4 // candidates - MAX_WARMUP - 3))
    if in_run and quiet is not None and not chosen:
        fits = quiet // max(1, candidates) - 1
        in_run, rounds = (True, min(rounds, fits)) if fits >= EARLY_ROUNDS else (False, aside_rounds)
    return in_run, rounds


class InRunRace:
    """Drives a race's steps (race.py's :data:`~mixprec.precision.race.Steps`) one training step at a time."""

    def __init__(self, steps: Steps, clock: Callable[[], float], device: torch.device, alone: bool = True) -> None:
        self._steps = steps
        self._alone = alone  # several processes: no step is judged by its own clock alone (they must agree)
        self._clock = clock
        self.device = device
        self._started: float | None = None
        self._next: Trial | None = None
        self.result: Any = None
        self.steps = 0
        self._send(None)

    def _send(self, outcome: Outcome | None) -> None:
        try:
            self._next = next(self._steps) if outcome is None else self._steps.send(outcome)
        except StopIteration as stop:
            self._next, self.result = None, stop.value

    @property
    def done(self) -> bool:
        """Whether the race has decided (``result`` holds what the steps returned)."""
        return self._next is None

    @property
    def in_step(self) -> bool:
        """Whether a step has begun and not ended (its forwards and backwards run in :meth:`begin`'s mode)."""
        return self._started is not None

    def begin(self) -> str:
        """The mode the training step starting now runs in; its clock starts (after a device sync)."""
        if self._next is None:
            raise RuntimeError("InRunRace.begin(): the race has already decided")
        synchronize(self.device)
        self._started = self._clock()
        return self._next[0]

    def end(self, outcome: bool | Unfinished | Failed) -> None:
        """The step's optimizer update is done: stop its clock and hand the race the outcome: whether its loss
        and gradients were finite, :class:`Unfinished` for a step that does not count as a trial (a loss
        scale backing off), or :class:`Failed` for one that raised (undone; the mode leaves the race). A
        step over the race's time limit is handed as stopped, with no progress."""
        if self._started is None:
            return
        synchronize(self.device)
        elapsed = self._clock() - self._started
        self._started = None
        self.steps += 1
        assert self._next is not None
        limit = self._next[1]
        if self._alone and limit is not None and elapsed > limit and isinstance(outcome, bool):
            outcome = Unfinished(0)
        self._send((outcome, elapsed))
