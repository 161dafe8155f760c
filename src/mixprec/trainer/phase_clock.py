"""Where a run's time goes (issue 36): host wall time per phase of the training loop, summed over the run.

The loop marks the end of each phase with :meth:`PhaseClock.lap` (one ``perf_counter`` call, ~0.1 us; no host
sync, nothing on the device). The summary reads it as the run's split (training steps, evaluations, saves,
compile, auto's race) and the step's (data, forward, backward, clip, optimizer, callbacks and logging, the rest)
in ms per step. Forward and backward are told apart by a lap inside ``Trainer.training_step``, between its
``compute_loss`` and its ``backward``; a ``training_step`` override that never calls it leaves its micro-batches
unsplit, counted as "forward_backward" (a key present only then).

What the figures mean depends on the device. On a CPU the kernels run on the calling thread, so each phase is
its compute plus its Python. On a GPU the kernels queue asynchronously: a phase is the host time it took to
launch them, and the wait lands on whichever phase synchronises next (the logging steps' loss read, the inf
check in the optimizer step: fp16's scaler, the other precisions' non-finite guard); a forward whose launches
run ahead of the device may so show as nearly free and the optimizer as the whole step. Either way, data +
callbacks/logging + the rest is what the loop adds around the model and optimizer: the host overhead compared
with a hand-written loop (benchmarks/bench_overhead.py).

Compile time is torch.compile's own (dynamo, AOT and inductor, forward and the lazily compiled backward), read
from dynamo's counters at each lap and taken out of the phase it was spent in: the first training steps'
forward+backward, and the first evaluation's (a model in eval mode under no_grad compiles again: 5.3 s of the
tiny GPT's 26.3 s on this CPU). So the step figures are the compiled step's, and an evaluation's its own.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

STEP_PHASES = ("data", "forward", "backward", "clip", "optimizer", "callbacks_logging")
"""A step's phases, in the order they run (with "forward_backward" after them where some went unsplit)."""
HOST_OVERHEAD = ("data", "callbacks_logging", "other")
"""The phases a hand-written loop would not have (or would have as little of)."""
UNSPLIT = "forward_backward"
"""Forward and backward of a micro-batch whose ``training_step`` laid no lap between them."""


def compile_seconds() -> float:
    """torch.compile's time in this process so far (dynamo's counters: each compiled frame and each lazily
    compiled backward); 0.0 where torch keeps no such counters."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without dynamo's counters
        return 0.0
    # "_compile.compile_inner" times a frame's whole compile (forward graph and AOT); the backward compiles at
    # its first call, timed apart as "backward._backward_impl" (torch 2.13; their sum is the first step's
    # extra time within 0.5%)
    return sum(
        sum(compilation_time_metrics.get(key, ())) for key in ("_compile.compile_inner", "backward._backward_impl")
    )


class PhaseClock:
    """Seconds per phase since :meth:`start`."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.compiled: dict[str, float] = defaultdict(float)
        """Compile seconds within each phase's seconds (dynamo's counters, read at each lap)."""
        self._compile_at_start = self._compile_mark = compile_seconds()
        self._setup = 0.0  # compile time dynamo's counters do not see (add_compile)
        self.last = ""
        """The phase of the latest lap ("" after :meth:`start`)."""
        self._within = ""  # every lap's phase, inside within()
        self.mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the last lap (or :meth:`start`) to ``phase``, and the compile time in it (a few
        dict reads and a sum over one entry per compiled graph: about a microsecond, no sync)."""
        now, phase = time.perf_counter(), self._within or phase
        self.seconds[phase] += now - self.mark
        self.mark, self.last = now, phase
        compiled = compile_seconds()
        if compiled != self._compile_mark:
            self.compiled[phase] += compiled - self._compile_mark
            self._compile_mark = compiled

    def add_compile(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` spent in ``phase`` since its last lap as compile time that dynamo's counters do not
        see: the first ``torch.compile`` of a process imports dynamo and inductor (3-11 s on this CPU)."""
        self.compiled[phase] += seconds
        self._setup += seconds

    @contextlib.contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """Every lap inside counts as ``phase``: steps taken again (auto's race replayed) lap their own phases."""
        self._within = phase
        try:
            yield
        finally:
            self._within = ""
        self.lap(phase)

    def breakdown(self, runtime: float, steps: int, race_seconds: float) -> dict[str, Any]:
        """The run's split in seconds and the step's in ms per step (``steps`` optimizer steps in ``runtime``
        seconds of run); "other" is what no phase claimed (the loop itself, the scheduler, events between)."""
        compiled = max(0.0, compile_seconds() - self._compile_at_start) + self._setup
        # each phase less the compile spent in it; a compile no lap has claimed yet is the training step's
        unclaimed = max(0.0, compiled - sum(self.compiled.values()))
        s = defaultdict(float, {p: max(0.0, t - self.compiled[p]) for p, t in self.seconds.items()})
        phases = list(STEP_PHASES) + ([UNSPLIT] if s[UNSPLIT] > 0 else [])
        first = UNSPLIT if UNSPLIT in phases else "forward"  # where an unclaimed compile was spent
        s[first] = max(0.0, s[first] - unclaimed)
        # an aside race (the shortest runs) is not a training step; an in-run race's trials are
        training = max(0.0, runtime - s["evaluation"] - s["save"] - s["race"] - compiled)
        per_step = {p: s[p] for p in phases}
        per_step["other"] = max(0.0, training - sum(per_step.values()))
        n = max(1, steps)
        per_step_ms = {p: round(1000 * v / n, 3) for p, v in per_step.items()}
        return {
            "run_seconds": {
                "training_steps": round(training, 3),
                "evaluation": round(s["evaluation"], 3),
                "save": round(s["save"], 3),
                "compile": round(compiled, 3),
                "race": round(race_seconds, 3),  # within the training steps when it ran as them
            },
            "step_ms": per_step_ms,
            "host_overhead_ms_per_step": round(sum(per_step_ms[p] for p in HOST_OVERHEAD), 3),
        }


def breakdown_rows(breakdown: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's split and the step's, as (label, text) rows for a summary table."""
    run, step = breakdown["run_seconds"], breakdown["step_ms"]
    names = {UNSPLIT: "forward+backward (unsplit)", "callbacks_logging": "callbacks/logging"}
    return [
        (
            "time split",
            f"training steps {run['training_steps']:.1f}s, evaluation {run['evaluation']:.1f}s, "
            f"saves {run['save']:.1f}s, compile {run['compile']:.1f}s, race {run['race']:.1f}s",
        ),
        (
            "per step",
            ", ".join(f"{names.get(p, p)} {v:.2f}" for p, v in step.items())
            + f" ms (host overhead {breakdown['host_overhead_ms_per_step']:.2f} ms)",
        ),
    ]


def format_breakdown(breakdown: dict[str, Any]) -> str:
    """Two summary lines: the run's split and the step's."""
    return "\n".join(f"  {label}: {text}" for label, text in breakdown_rows(breakdown))
