"""What "auto" measured and chose: the decision a race (race.py) makes, as logs, summaries, checkpoints and the
cache (auto_cache.py) keep it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mixprec.precision.compile_choice import CompileFigures

if TYPE_CHECKING:
    from mixprec.precision.base import Precision

ABORT_RATIO = 1.5  # the race stops a warm-up trial taking this much longer than the safest mode's settled trial


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
    # each less safe mode's speed against the safest, as a 95% interval from the paired rounds (low, high)
    speedup_interval: dict[str, list[float]] = field(default_factory=dict)
    clock: str = "wall clock"  # what the times are: "thread CPU time" on a CPU, the wall clock on a GPU
    measured_at: str = ""  # when the race ran (UTC, ISO 8601): a cached decision says how old it is
    checked: str = ""  # a cached decision's re-check in this run: what was measured, and the verdict
    op_timing: str = ""  # the per-op-kind timing behind a policy candidate (op_timing.OpTimingReport.explain)
    op_timing_seconds: float = 0.0  # what that timing took (before the race: not in cost_seconds)
    # the race's trials were the run's first training steps (this many), not trials aside from it: its cost is
    # then their time over the chosen mode's
    in_run_steps: int = 0
    # asked to compile (issue 36 item 4): what compiling measured and whether it was kept (compile_choice.py)
    compile: dict[str, Any] = field(default_factory=dict)
    # the Trainer then took those steps again in the chosen mode from a snapshot of the run before them
    # (trainer/race_rewind.py): this many optimizer steps, in this many seconds (counted in cost_seconds)
    replayed_steps: int = 0
    replay_seconds: float = 0.0

    def _ordered(self, names: Any) -> list[str]:
        """``names`` safest first (the cache's JSON keeps its keys sorted by name)."""
        rank = {name: i for i, name in enumerate(self.candidates)}
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

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
        for name in [*self._ordered(self.step_seconds), *(n for n in self.excluded if n not in self.step_seconds)]:
            cells = [f"{name:<6}"]
            if name in self.step_seconds:
                cells.append(f"{self.step_seconds[name] * 1e3:9.1f} ms median")
                if name in self.best_seconds:
                    cells.append(f"{self.best_seconds[name] * 1e3:9.1f} ms best")
                cells.append(f"{speed.get(name, 0.0):5.2f}x")
            if name in self.speedup_interval:
                low, high = self.speedup_interval[name]
                cells.append(f"(95% interval {low:.2f}-{high:.2f}x)")
            if name in self.dropped:
                cells.append(f"dropped after {self.dropped[name]} timed round(s): not faster")
            if name in self.excluded:
                cells.append(f"excluded: {self.excluded[name]}")
            if name == self.chosen:
                cells.append("<- chosen")
            lines.append("  ".join(cells))
        if self.op_timing:
            lines.append(self.op_timing)
        return "\n".join(lines)

    def explain(self) -> str:
        """One sentence: what was measured, where, when and how, and what was chosen."""
        checked = f"; {self.checked}" if self.checked else ""
        checked += f"; {CompileFigures.from_dict(self.compile).explain()}" if self.compile else ""
        if self.source == "guess":
            return self.measured + checked
        speed = self.speedups()
        parts = []
        for name in self._ordered(self.step_seconds):
            seconds = self.step_seconds[name]
            cell = f"{name} {seconds * 1e3:.1f} ms ({speed.get(name, 0.0):.2f}x"
            if name in self.speedup_interval:
                low, high = self.speedup_interval[name]
                cell += f", 95% interval {low:.2f}-{high:.2f}x"
            parts.append(cell + ")" + (" (dropped: not faster)" if name in self.dropped else ""))
        for name in self.dropped:
            if name not in self.step_seconds:
                parts.append(f"{name} dropped (its warm-up trials ran over {ABORT_RATIO:g}x the safest mode's)")
        for name, why in self.excluded.items():
            parts.append(f"{name} excluded: {why}")
        how = {
            "measured": "raced",
            "cache": "reused a cached race of",
            "checkpoint": "kept the checkpoint's decision from racing",
            "main process": "took the main process's race of",
        }.get(self.source, self.source)
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        when = f", {self.measured_at}" if self.measured_at else ""
        cost = f"; the race took {self.cost_seconds:.1f}s" if self.source == "measured" else ""
        if self.in_run_steps and self.source == "measured":
            cost = f"; the race ran as {self.in_run_steps} of the run's training steps, "
            if self.replayed_steps:
                cost += (
                    f"then the run went back to before them and took them again in {self.chosen} "
                    f"({self.replayed_steps} steps, {self.replay_seconds:.2f}s): {self.cost_seconds:.2f}s in all over "
                    "the chosen mode's"
                )
            else:
                cost += f"{self.cost_seconds:.2f}s slower than the chosen mode's steps"
        return (
            f"auto on {self.device} {how} the candidates on {self.measured} ({threads}, {self.clock}, "
            f"{self.rounds} paired rounds{when}; medians: {'; '.join(parts) or 'nothing timed'}) and chose "
            f"{self.chosen}{cost}{checked}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (what checkpoints, ``train_summary.json`` and the cache hold)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoDecision:
        """Rebuild from :meth:`to_dict`'s output; keys this version does not know are skipped."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_source(self, source: str) -> AutoDecision:
        """A copy whose ``source`` says where the decision came from ("measured", "cache", "main process"...)."""
        return replace(self, source=source)

    def reused_here(self, checked: str, seconds: float) -> AutoDecision:
        """This cached decision as the run's: re-checked (``checked`` says how) in ``seconds``, all it cost here."""
        return replace(self, checked=checked, cost_seconds=seconds, op_timing_seconds=0.0)

    @property
    def seconds_this_run(self) -> float:
        """What deciding cost the run that holds this decision: the op timing and the race (its replay too), or a
        cached decision's re-check; nothing for a checkpoint's, kept from the run that measured it."""
        return 0.0 if self.source == "checkpoint" else self.op_timing_seconds + self.cost_seconds

    def with_replay(self, steps: int, seconds: float) -> AutoDecision:
        """This decision after the Trainer replayed the race's ``steps`` in the chosen mode, in ``seconds``
        (counted in the race's cost)."""
        return replace(self, replayed_steps=steps, replay_seconds=seconds, cost_seconds=self.cost_seconds + seconds)


def excluded_by_format(candidates: Iterable[Precision], unsafe: Mapping[str, str]) -> dict[str, str]:
    """The candidates that compute in a format named in ``unsafe`` (a format's name -> why, e.g. a diagnosis that
    saw it overflow), each with why: each candidate is asked its own format, never judged by its name."""
    return {p.name: unsafe[p.compute_format.name] for p in candidates if p.compute_format.name in unsafe}
