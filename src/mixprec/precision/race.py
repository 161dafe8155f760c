"""The race behind precision="auto": time each candidate mode on the user's own training step, pick the fastest.

A stand-in workload cannot know which mode wins for *this* model, batch and device (on one CPU fp16 matmuls
win, on the next bf16 runs 5x slower than fp32, on a third 4x faster), so the race runs the real thing:
``run(name)`` is one forward and backward of the user's model on the user's batch under mode ``name``, with
the threads training will use. The protocol (STYLE.md habit 13, as ``mixprec bench``):

1. a warm-up run of every candidate (first calls pay for kernel selection and allocation), not timed
   but bounded: a candidate still running ``ABORT_RATIO`` times as long as the safest one's warm-up is
   stopped mid-forward and dropped (an emulated fp16 step can take 15x fp32's: one whole run of it would
   cost more than the rest of the race);
2. ``rounds`` timed rounds, the order rotated each round so a noisy neighbour hurts every mode alike (two
   when, after two, every mode is far from the margin: the race's cost is a share of the user's run);
   from the third round on, a mode whose best time is ``DROP_RATIO`` times the fastest one's stops
   running (an emulated low precision can be 10x slower: timing it again would only cost);
3. a lower-precision mode is chosen only if it beats every safer mode by ``MARGIN`` on the median time and
   its best time is lower too (noise only ever adds time), so ties go to the numerically safer mode;
4. a candidate whose trial is non-finite while the fp32 one is finite is excluded, with the reason.

Processes of one job must make the same decision and run the same trials (under DDP or FSDP a backward is
a collective): ``agree`` hands every process the main one's list of modes still racing after each round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MARGIN = 0.05  # a lower precision must be at least 5% faster than every safer one
DROP_RATIO = 1.5  # stop timing a mode this much slower (best vs best) than the fastest
ABORT_RATIO = 1.5  # stop a warm-up run taking this much longer than the safest mode's warm-up
ROUNDS = 3

Agree = Callable[[list[str]], list[str]]
Clock = Callable[[], float]
Run = Callable[[str, "float | None"], "bool | None"]


@dataclass(frozen=True)
class AutoDecision:
    """What "auto" measured and chose, for logs, summaries and checkpoints (JSON-ready via ``to_dict``).

    ``step_seconds``/``best_seconds`` hold the median and minimum time of one forward+backward per measured
    mode; ``excluded`` says why a candidate was not chosen whatever its speed; ``source`` says where the
    decision came from: "measured" here, "cache" (an earlier identical measurement), "checkpoint" (a resumed
    run keeps its decision), "main process" (another process measured it), or "guess" (no step to measure).
    """

    chosen: str
    step_seconds: dict[str, float]
    best_seconds: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # mode -> timed rounds it ran before it was dropped
    rounds: int = 0
    threads: int = 1
    cost_seconds: float = 0.0
    device: str = "cpu"
    source: str = "measured"
    measured: str = "the training step (forward and backward of its first batch)"
    candidates: list[str] = field(default_factory=list)  # every mode that could have been chosen, safest first

    def speedups(self) -> dict[str, float]:
        """Each measured mode's speed relative to the safest measured one (fp32 where measured)."""
        if not self.step_seconds:
            return {}
        base = self.step_seconds.get("fp32", next(iter(self.step_seconds.values())))
        return {name: base / t for name, t in self.step_seconds.items() if t > 0}

    def table(self) -> str:
        """One line per candidate: median and best ms, speed vs fp32, or why it was excluded."""
        lines = []
        speed = self.speedups()
        for name in [*self.step_seconds, *(n for n in self.excluded if n not in self.step_seconds)]:
            cells = [f"{name:<6}"]
            if name in self.step_seconds:
                cells.append(f"{self.step_seconds[name] * 1e3:9.1f} ms median")
                if name in self.best_seconds:
                    cells.append(f"{self.best_seconds[name] * 1e3:9.1f} ms best")
                cells.append(f"{speed.get(name, 0.0):5.2f}x")
            if name in self.dropped:
                cells.append(f"dropped after {self.dropped[name]} timed round(s): too slow to win")
            if name in self.excluded:
                cells.append(f"excluded: {self.excluded[name]}")
            if name == self.chosen:
                cells.append("<- chosen")
            lines.append("  ".join(cells))
        return "\n".join(lines)

    def explain(self) -> str:
        """One sentence: what was measured and what was chosen."""
        if self.source == "guess":
            return self.measured
        speed = self.speedups()
        parts = []
        for name, seconds in self.step_seconds.items():
            note = " (dropped: too slow)" if name in self.dropped else ""
            parts.append(f"{name} {seconds * 1e3:.1f} ms ({speed.get(name, 0.0):.2f}x){note}")
        for name in self.dropped:
            if name not in self.step_seconds:
                parts.append(f"{name} dropped (its warm-up ran over {ABORT_RATIO:g}x the safest mode's)")
        for name, why in self.excluded.items():
            parts.append(f"{name} excluded: {why}")
        how = {
            "measured": "raced",
            "cache": "reused a cached race of",
            "checkpoint": "kept the checkpoint's decision from racing",
            "main process": "took the main process's race of",
        }.get(self.source, self.source)
        cost = f"; the race took {self.cost_seconds:.2f}s" if self.source == "measured" else ""
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return (
            f"auto on {self.device} {how} the candidates on {self.measured} ({threads}, {self.rounds} timed "
            f"rounds, medians: {'; '.join(parts) or 'nothing timed'}) and chose {self.chosen}{cost}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoDecision:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_source(self, source: str) -> AutoDecision:
        return AutoDecision(**{**asdict(self), "source": source})


def race(
    candidates: Sequence[str],
    run: Run,
    *,
    rounds: int = ROUNDS,
    clock: Clock = time.perf_counter,
    agree: Agree | None = None,
    excluded: dict[str, str] | None = None,
) -> tuple[dict[str, list[float]], dict[str, str], dict[str, int]]:
    """Run the trials; return each mode's timed samples, the excluded modes with why, and the dropped ones.

    ``candidates`` are in order of numerical safety (safest first). ``run(name, deadline)`` performs one
    trial and returns whether it was finite, or None if it stopped at ``deadline`` (a ``clock()`` value)
    unfinished; it must leave the device idle when it returns (the clock is read around it). ``agree``
    (several processes) returns the main process's list for everyone.
    """
    same: Agree = agree or (lambda names: names)
    out: dict[str, str] = dict(excluded or {})
    racing = same([c for c in candidates if c not in out])
    samples: dict[str, list[float]] = {c: [] for c in racing}
    dropped: dict[str, int] = {}
    finite: dict[str, bool | None] = {}
    reference = racing[0] if racing else None  # the safest mode: its trial tells a broken step from overflow
    budget: float | None = None
    for name in racing:  # warm-up, untimed: its finiteness is the safety check
        t0 = clock()
        finite[name] = run(name, None if budget is None else t0 + budget)
        if budget is None:  # the safest mode's first run (inflated by one-time costs: a lenient deadline)
            budget = (clock() - t0) * ABORT_RATIO
        if finite[name] is None:
            dropped[name] = 0
    if reference is not None and finite[reference]:
        for name in racing[1:]:
            if finite[name] is False:
                out[name] = f"its trial's loss or gradients were inf/NaN while {reference}'s were finite"
    racing = same([c for c in racing if c not in out and c not in dropped])
    for r in range(rounds):
        order = racing[r % len(racing) :] + racing[: r % len(racing)] if racing else []
        for name in order:
            t0 = clock()
            run(name, None)
            samples[name].append(clock() - t0)
        if len(racing) > 1 and r >= 2:  # three samples at least: a noisy sample or two must not drop a mode
            fastest = min(min(samples[c]) for c in racing)
            keep = [c for c in racing if min(samples[c]) <= fastest * DROP_RATIO or c == racing[0]]
            for c in racing:
                if c not in keep:
                    dropped[c] = r + 1
            racing = same(keep)
        # every mode far from the margin after two rounds: a third would not change the choice (the main
        # process's verdict for all, as a non-empty list: every process must run the same trials)
        if r == 1 and r + 1 < rounds and same(list(racing) if _decided(racing, samples) else []):
            break
    return {c: s for c, s in samples.items() if s}, out, dropped


def _decided(racing: Sequence[str], samples: dict[str, list[float]]) -> bool:
    """Whether each less safe mode is clearly on one side of the margin against the safest one: within half
    the margin of it or slower, on both samples' mean (it cannot win), or faster by twice the margin on both
    samples (it wins whatever a third sample says). Close calls get the third round."""
    base = statistics.mean(samples[racing[0]])
    for name in racing[1:]:
        ratio = statistics.mean(samples[name]) / base
        if not (ratio >= 1 - MARGIN / 2 or max(samples[name]) < min(samples[racing[0]]) * (1 - 2 * MARGIN)):
            return False
    return True


def choose(order: Sequence[str], medians: dict[str, float], minima: dict[str, float]) -> str:
    """The safest mode, unless a less safe one (later in ``order``) beats the current pick by ``MARGIN`` on
    the median time, and its best time is lower too (noise only ever adds time: a median win that the best
    times contradict is a busy machine's, not the mode's). Requiring the margin of the best times as well
    made the choice flip on noise: on the default ``mixprec train`` a bf16 step 8% faster by the median lost
    to fp32 on a 4% difference of the best of three samples, while the run trained 12% faster in bf16."""
    timed = [name for name in order if name in medians]
    if not timed:
        return order[0]
    best = timed[0]
    for name in timed[1:]:
        if medians[name] < medians[best] * (1 - MARGIN) and minima[name] < minima[best]:
            best = name
    return best


def decide(
    candidates: Sequence[str],
    run: Run,
    *,
    device: str,
    threads: int,
    rounds: int = ROUNDS,
    clock: Clock = time.perf_counter,
    agree: Agree | None = None,
    excluded: dict[str, str] | None = None,
    measured: str | None = None,
) -> AutoDecision:
    """Race ``candidates`` (safest first) and return the decision, its table and its cost."""
    start = time.perf_counter()
    samples, out, dropped = race(candidates, run, rounds=rounds, clock=clock, agree=agree, excluded=excluded)
    ran = max((len(ts) for ts in samples.values()), default=0)
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    minima = {name: min(ts) for name, ts in samples.items()}
    chosen = choose([c for c in candidates if c not in out], medians, minima)
    if agree is not None:
        chosen = agree([chosen])[0]
    return AutoDecision(
        chosen=chosen,
        step_seconds=medians,
        best_seconds=minima,
        excluded=out,
        dropped=dropped,
        rounds=ran,
        threads=threads,
        cost_seconds=time.perf_counter() - start,
        device=device,
        candidates=list(candidates),
        **({"measured": measured} if measured else {}),
    )
