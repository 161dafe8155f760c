"""The race behind precision="auto": time each candidate mode on the user's own training step, pick the fastest.

A stand-in workload cannot know which mode wins for *this* model, batch and device (on one CPU fp16 matmuls
win, on the next bf16 runs 5x slower than fp32, on a third 4x faster), so the race runs the real thing:
``run(name, deadline)`` is one forward and backward of the user's model on the user's batch under mode
``name``, with the threads training will use. Its verdict must not depend on the moment it ran (issue 29:
three fresh races on one quiet machine gave bf16, bf16, fp32), so the protocol is (STYLE.md habit 13, as
``mixprec bench``):

1. **warm-up until settled** (issue 28: counting a GPU's first bf16 calls, cuBLAS handles and kernel
   selection, against bf16 made auto train in fp32 at a quarter of bf16's speed): every candidate runs
   untimed trials until two consecutive ones differ by less than ``SETTLED`` (at most ``MAX_WARMUP``). A
   candidate's trial is stopped at ``ABORT_RATIO`` times the safest mode's settled trial, and the candidate is
   dropped only when ``MAX_STALLS`` stopped trials in a row got no further (``Unfinished.progress``) than the
   furthest before: a mode paying one-time setup gets further every trial or two, an emulated fp16 15x slower
   than fp32 stops at the same place every time;
2. **paired rounds**: each round runs every candidate once, back to back in a rotated order, and the
   comparison is the ratio of two modes' times *in the same round* (a neighbour's burst slows both halves
   of a pair, not one mode's whole median), on the clock of :func:`~mixprec.precision.trial.race_clock`;
3. **confidence**: from ``EARLY_ROUNDS`` rounds, each less safe mode's paired time ratio against each safer
   mode gets a 95% interval (paired.py). Entirely below ``1 - MARGIN``: it *wins*; entirely above: it is *not
   faster* (a tie goes to the safer mode; a mode not faster than a safer one stops running, and the safest
   stops once every other mode beats it). Rounds continue while a pair is undecided, up to ``MAX_ROUNDS`` or
   the budget (``BUDGET_SHARE`` of the run, when the run's length is known, and only from ``MIN_ROUNDS``); a
   pair still undecided then is a tie;
4. a lower-precision mode is chosen only if it wins against every safer mode still racing; a candidate
   whose trial is non-finite while the safest one's is finite is excluded, with the reason.

Processes of one job must make the same decision and run the same trials (under DDP or FSDP a backward is
a collective): ``agree`` hands every process the main one's list (of modes still racing, or of a verdict)
at each point where the trials that follow depend on it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from mixprec.precision.decision import ABORT_RATIO, AutoDecision
from mixprec.precision.paired import (  # noqa: F401  (the verdicts' names, also read as race.X)
    EARLY_ROUNDS,
    MARGIN,
    NOT_FASTER,
    UNDECIDED,
    WINS,
    choose,
    choose_paired,
    speedup_interval,
    verdict,
)

SETTLED = 0.9  # warmed up: a trial no more than 10% faster than the one before it
MAX_WARMUP = 5  # whole untimed trials per candidate at most
MAX_STOPPED = 20  # warm-up trials stopped at their deadline, per candidate, at most
MAX_STALLS = 2  # stopped trials in a row that got no further: the candidate is this slow, dropped
PROGRESS_STEP = 0.1  # a stopped trial is still setting up if it got 10% further (one checkpoint at least)
MIN_ROUNDS = 6  # paired rounds before a tie is called: the sign test's 95% interval needs 6 pairs
MAX_ROUNDS = 20
BUDGET_SHARE = 0.03  # the timed rounds stop once the race has cost this share of the run (issue 28: <= 3%)


Agree = Callable[[list[str]], list[str]]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Unfinished:
    """What ``run`` returns for a trial stopped at its deadline: ``progress`` counts the checkpoints it passed
    (module calls in the forward, saved-tensor reads in the backward) before it was stopped."""

    progress: int


@dataclass(frozen=True)
class Failed:
    """What an in-run race step hands the race when its candidate raised (inrun.py): the step was undone
    and the mode leaves the race, ``reason`` saying why."""

    reason: str


Run = Callable[[str, "float | None"], "bool | Unfinished"]


Trial = tuple[str, "float | None"]
"""What a race asks for next: one trial of a mode, and how long it may take (``None``: no limit)."""
Outcome = tuple["bool | Unfinished | Failed", float]
"""How that trial ended (finite, or stopped unfinished) and how long it took on the race's clock."""
Steps = Generator[Trial, Outcome, Any]
"""A race written as steps: it yields the trials it wants and is sent each one's outcome. :func:`drive` runs
them back to back (a race aside from training); ``inrun.InRunRace`` makes each one a real training step."""


def drive(steps: Steps, run: Run, clock: Clock) -> Any:
    """Run ``steps``' trials one after another, each ``run(name, deadline)`` timed on ``clock``; return what
    ``steps`` returns."""
    try:
        name, limit = next(steps)
        while True:
            t0 = clock()
            outcome = run(name, None if limit is None else t0 + limit)
            name, limit = steps.send((outcome, clock() - t0))
    except StopIteration as stop:
        return stop.value


@dataclass
class Spent:
    """What a race's trials have cost so far: their clock time and how many ran, and the first one's mode."""

    seconds: float = 0.0
    trials: int = 0
    first: tuple[str, float] | None = None

    def add(self, seconds: float, name: str = "") -> None:
        self.seconds += seconds
        self.trials += 1
        if self.first is None:
            self.first = (name, seconds)

    def cost(self, fastest: float, in_run: bool, medians: Mapping[str, float] | None = None) -> float:
        """Aside from training every trial is extra; as training steps only the time over the fastest mode's,
        the run's first step counted at its mode's median (``medians``): its one-time costs (the optimizer's
        state, the allocator's first blocks) are every run's, raced or not."""
        if not in_run:
            return self.seconds
        seconds = self.seconds
        if self.first is not None and medians and self.first[0] in medians:
            seconds += medians[self.first[0]] - self.first[1]
        return seconds - self.trials * fastest


def race_steps(
    candidates: Sequence[str],
    *,
    rounds: int = MAX_ROUNDS,
    agree: Agree | None = None,
    excluded: dict[str, str] | None = None,
    run_steps: int | None = None,
    in_run: bool = False,
    spent: Spent | None = None,
) -> Generator[Trial, Outcome, tuple[dict[str, list[float]], dict[str, str], dict[str, int]]]:
    """The race as steps (see :data:`Steps`); returns each mode's timed samples (one per round, paired by
    index), the excluded modes with why, and the dropped ones (mode -> timed rounds it ran).

    ``candidates`` are in order of numerical safety (safest first). ``rounds`` caps the paired rounds;
    ``run_steps`` (the run's length in steps, if known) caps the race's cost (:meth:`Spent.cost`, ``in_run``:
    the trials are the run's own steps) at ``BUDGET_SHARE`` of it. ``agree`` (several processes) returns the
    main process's list for all.
    """
    same: Agree = agree or (lambda names: names)
    spent = spent if spent is not None else Spent()
    out: dict[str, str] = dict(excluded or {})
    racing = same([c for c in candidates if c not in out])
    samples: dict[str, list[float]] = {c: [] for c in racing}
    dropped: dict[str, int] = {}
    limit: float | None = None  # a candidate's trial may take this long: ABORT_RATIO x the safest's settled trial
    finite: dict[str, bool] = {}
    for name in racing:
        warm = yield from warm_up_steps(name, limit, same, spent, once=in_run)
        if isinstance(warm, Failed):
            out[name] = warm.reason
            continue
        if warm is None:
            dropped[name] = 0
            continue
        finite[name], settled_time = warm
        if limit is None:  # the safest mode: no deadline for it, and its settled trial sets the others'
            limit = settled_time * ABORT_RATIO
    reference = racing[0] if racing else None  # the safest mode: its trial tells a broken step from overflow

    if reference is not None and finite.get(reference):
        for name in racing[1:]:
            if finite.get(name) is False:
                out[name] = f"its trial's loss or gradients were inf/NaN while {reference}'s were finite"
    racing = same([c for c in racing if c not in out and c not in dropped])
    for r in range(rounds):
        for name in racing[r % len(racing) :] + racing[: r % len(racing)]:
            outcome, elapsed = yield (name, None)
            spent.add(elapsed, name)
            if isinstance(outcome, Failed):  # raised in a timed round: out, its samples with it
                out[name] = outcome.reason
                samples[name] = []
                continue
            samples[name].append(elapsed)
        racing = [c for c in racing if c not in out]  # (Failed comes in-run only, where one process races)
        if len(racing) < 2:
            break
        if r + 1 < EARLY_ROUNDS:
            if in_run and run_steps is not None:
                racing = same(_afford(racing, samples, dropped, spent, run_steps, EARLY_ROUNDS - r - 1))
            continue
        # a mode not faster than a safer one still racing cannot be chosen (choose_paired): stop timing it
        keep = [
            c for i, c in enumerate(racing) if all(verdict(samples[c], samples[s]) != NOT_FASTER for s in racing[:i])
        ]
        for c in racing:
            if c not in keep:
                dropped[c] = r + 1
        # every other mode beats the safest: timing it further decides nothing
        if len(keep) > 2 and all(verdict(samples[c], samples[keep[0]]) == WINS for c in keep[1:]):
            keep = keep[1:]
        racing = same(keep)
        medians = {c: statistics.median(samples[c]) for c in samples if samples[c]}
        fastest = min(medians[c] for c in racing)
        cost = spent.cost(fastest, in_run, medians)
        over_budget = run_steps is not None and cost > BUDGET_SHARE * run_steps * fastest
        # a tie is called on MIN_ROUNDS pairs at least (calling it at EARLY_ROUNDS in-run was tried: under a
        # neighbour's bursts a 2.7x median gap was still undecided at 3 rounds and the run trained in fp32)
        over_budget = over_budget and r + 1 >= MIN_ROUNDS
        settled = all(verdict(samples[c], samples[s]) != UNDECIDED for i, c in enumerate(racing) for s in racing[:i])
        if same(["stop"] if settled or over_budget or len(racing) < 2 else []):
            break
    return {c: s for c, s in samples.items() if s}, out, dropped


def _afford(
    racing: list[str],
    samples: Mapping[str, list[float]],
    dropped: dict[str, int],
    spent: Spent,
    run_steps: int,
    rounds_left: int,
) -> list[str]:
    """The modes an in-run race can still afford to time (issue 36: a short run). When the race's cost so far
    plus ``rounds_left`` more rounds of every mode's gap to the fastest would pass its budget (``BUDGET_SHARE``
    of the run), a less safe mode not faster by ``MARGIN`` than a safer one on its samples so far leaves
    (dropped, as a mode not faster does at ``EARLY_ROUNDS``): it could be chosen only by beating that mode, and
    the run is too short to pay for finding out. The safest mode always stays, and the comparison with it is
    left to the paired rounds: one sample under a neighbour's burst once dropped bf16 at 1.4x fp32's time,
    where its quiet step is 0.65x."""
    medians = {c: statistics.median(samples[c]) for c in racing if samples[c]}
    if len(medians) < len(racing):
        return racing
    fastest = min(medians.values())
    projected = spent.cost(fastest, True, medians) + rounds_left * sum(m - fastest for m in medians.values())
    if projected <= BUDGET_SHARE * run_steps * fastest:
        return racing
    keep = [c for i, c in enumerate(racing) if all(medians[c] < (1 - MARGIN) * medians[s] for s in racing[1:i])]
    for c in racing:
        if c not in keep:
            dropped[c] = len(samples[c])
    return keep


def warm_up_steps(
    name: str, limit: float | None, same: Agree, spent: Spent | None = None, once: bool = False
) -> Generator[Trial, Outcome, tuple[bool, float] | Failed | None]:
    """Untimed trials of ``name`` until its trial time settles (at most ``MAX_WARMUP`` whole trials): whether
    it was finite and its last trial's time. None when it is dropped: ``MAX_STALLS`` trials in a row stopped
    at their deadline no further (by ``PROGRESS_STEP``) than the furthest one before (slow, not setting
    up: setup that repeats at one place, as a recompile on the second call, stalls once), or ``MAX_STOPPED``
    stopped trials. Several processes agree after each trial whether to go on (they run the same trials;
    their trials are never stopped). ``once``: one finished trial is enough (a race run as the training
    steps, after the per-op-kind replays ran every kernel on these shapes: a step takes its mode's
    one-time setup, and any left shows as noise that the paired rounds' intervals absorb). A trial that
    raised (:class:`Failed`, in-run only) ends the warm-up with it."""
    times: list[float] = []
    furthest, stalls, stopped = -1, 0, 0
    finite = True
    while len(times) < MAX_WARMUP:
        outcome, elapsed = yield (name, limit)
        if spent is not None:
            spent.add(elapsed, name)
        if isinstance(outcome, Failed):
            return outcome
        if isinstance(outcome, Unfinished):
            stopped += 1
            if outcome.progress >= furthest + max(1, furthest * PROGRESS_STEP):
                furthest, stalls = outcome.progress, 0
            else:
                stalls += 1
            if stalls >= MAX_STALLS or stopped >= MAX_STOPPED:
                return None  # stuck at the same place: it is this slow, not paying one-time setup
            continue
        finite = finite and bool(outcome)
        times.append(elapsed)
        settled = not finite or once or (len(times) >= 2 and times[-1] >= SETTLED * times[-2])
        if same(["settled"] if settled else []):  # every process asks, every time: same trials for all
            break
    return finite, times[-1]


CHECK_TRIALS = 5  # timed trials of the chosen mode when a cached decision is re-checked
CHECK_RATIO = 1.3  # a cached decision whose chosen mode now times this far off (either way) is raced again


def recheck_steps(decision: AutoDecision, clock_name: str) -> Generator[Trial, Outcome, tuple[bool, str]]:
    """Time a cached decision's chosen mode now (warmed up, then ``CHECK_TRIALS`` trials) and compare with
    what the race measured. Returns whether the cache still holds and a sentence saying what was compared
    (issue 29: a race taken under load, 6x off the quiet machine's step, was reused as fact). It holds when
    now's best trial lies within ``CHECK_RATIO`` of the cached race's range (its best to its median): noise
    only adds time, so best against best is the steady comparison. Costs a few trials of one mode."""
    best, median = decision.best_seconds.get(decision.chosen), decision.step_seconds.get(decision.chosen)
    if best is None or median is None or decision.clock != clock_name:
        return False, f"the cached race has no {decision.chosen} time on this clock ({clock_name}) to check against"
    yield from warm_up_steps(decision.chosen, None, lambda xs: xs)
    times = []
    for _ in range(CHECK_TRIALS):
        _, elapsed = yield (decision.chosen, None)
        times.append(elapsed)
    now = min(times)
    holds = best / CHECK_RATIO <= now <= median * CHECK_RATIO
    outcome = "within the noise" if holds else f"off by over {CHECK_RATIO:g}x, so raced again"
    return holds, (
        f"checked now: {decision.chosen}'s best trial {now * 1e3:.1f} ms against {best * 1e3:.1f}-"
        f"{median * 1e3:.1f} ms cached (best-median): {outcome}"
    )


def recheck(decision: AutoDecision, run: Run, clock: Clock, clock_name: str) -> tuple[bool, str, float]:
    """:func:`recheck_steps` run back to back; the wall seconds it took last."""
    start = time.perf_counter()
    holds, note = drive(recheck_steps(decision, clock_name), run, clock)
    return holds, note, time.perf_counter() - start


def reuse(
    chosen: str,
    cached: AutoDecision | None,
    device: str,
    check: Callable[[AutoDecision], tuple[bool, str, float]] | None,
) -> tuple[AutoDecision | None, str]:
    """A decision taken as it was: the cache's (``cached``, when it chose ``chosen``), re-checked by ``check``
    (:func:`recheck`; None where several processes take the main one's, unchecked), or the main process's.
    Returns it, costing this run only its re-check, or None and why the cache did not hold."""
    source = "cache" if cached is not None and cached.chosen == chosen else "main process"
    base = cached if cached is not None else AutoDecision(chosen, {}, device=device)
    reused = replace(base, chosen=chosen, source=source, checked="")
    if source != "cache" or check is None:
        return reused.reused_here("not re-checked (several processes take the main one's)", 0.0), ""
    holds, note, seconds = check(reused)
    if holds:
        return reused.reused_here(note, seconds), ""
    return None, f"the cached race of {reused.measured_at or 'an earlier run'} did not hold ({note})"


def decide_steps(
    candidates: Sequence[str],
    *,
    device: str,
    threads: int,
    rounds: int = MAX_ROUNDS,
    clock_name: str = "wall clock",
    agree: Agree | None = None,
    excluded: dict[str, str] | None = None,
    measured: str | None = None,
    run_steps: int | None = None,
    in_run: bool = False,
) -> Generator[Trial, Outcome, AutoDecision]:
    """The race as steps (:func:`race_steps`), returning the decision, its table and its cost: the wall
    seconds it took aside from training; the race clock's seconds over the chosen mode's when ``in_run``."""
    start = time.perf_counter()
    spent = Spent()
    samples, out, dropped = yield from race_steps(
        candidates, rounds=rounds, agree=agree, excluded=excluded, run_steps=run_steps, in_run=in_run, spent=spent
    )
    ran = max((len(ts) for ts in samples.values()), default=0)
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    minima = {name: min(ts) for name, ts in samples.items()}
    chosen = choose_paired([c for c in candidates if c not in out], samples, dropped)
    if agree is not None:
        chosen = agree([chosen])[0]
    reference = next(iter(samples), None)  # the safest mode timed
    intervals = {}
    for name in list(samples)[1:]:
        low, _, high = speedup_interval(samples[name], samples[reference])
        if 0 < low and high < math.inf:
            intervals[name] = [round(low, 4), round(high, 4)]
    cost = spent.cost(medians.get(chosen, 0.0), True, medians) if in_run else time.perf_counter() - start
    return AutoDecision(
        chosen=chosen,
        step_seconds=medians,
        best_seconds=minima,
        excluded=out,
        dropped=dropped,
        rounds=ran,
        threads=threads,
        cost_seconds=max(cost, 0.0),
        device=device,
        candidates=list(candidates),
        speedup_interval=intervals,
        clock=clock_name,
        measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        in_run_steps=spent.trials if in_run else 0,
        **({"measured": measured} if measured else {}),
    )


def decide(
    candidates: Sequence[str],
    run: Run,
    *,
    clock: Clock = time.perf_counter,
    **kwargs: Any,
) -> AutoDecision:
    """Race ``candidates`` (safest first) aside from training, each trial ``run(name, deadline)`` timed on
    ``clock``: it returns whether the trial was finite, or :class:`Unfinished` if it stopped at ``deadline`` (a
    ``clock()`` value), and leaves the device idle (the clock is read around it). The keyword arguments are
    :func:`decide_steps`'."""
    return drive(decide_steps(candidates, **kwargs), run, clock)
