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

Compile time is torch.compile's own (dynamo, AOT and inductor for the forward, the lazily compiled backward),
read from dynamo's counters; it is spent inside the first steps' forward and backward and is taken out of them
here, so the step figures are the compiled step's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

STEP_PHASES = ("data", "forward", "backward", "clip", "optimizer", "callbacks_logging")
"""A step's phases, in the order they run (with "forward_backward" after them where some went unsplit)."""
HOST_OVERHEAD = ("data", "callbacks_logging", "other")
"""The phases a hand-written loop would not have (or would have as little of)."""
UNSPLIT = "forward_backward"
"""Forward and backward of a micro-batch whose ``training_step`` laid no lap between them."""

# dynamo's counters: "_compile.compile_inner" times a frame's whole compile (forward graph and AOT); the backward
# compiles at its first call, timed apart as "backward._backward_impl" (torch 2.13; their sum is the first step's
# extra time within 0.5%)
_COMPILE_KEYS = {"forward": "_compile.compile_inner", "backward": "backward._backward_impl"}


def compile_parts() -> dict[str, float]:
    """torch.compile's time in this process so far, by the phase it is spent in (forward: each compiled frame;
    backward: each lazily compiled backward); zeros where torch keeps no such counters."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without dynamo's counters
        return dict.fromkeys(_COMPILE_KEYS, 0.0)
    return {phase: sum(compilation_time_metrics.get(key, ())) for phase, key in _COMPILE_KEYS.items()}


def compile_seconds() -> float:
    """torch.compile's time in this process so far (forward and backward together)."""
    return sum(compile_parts().values())


class PhaseClock:
    """Seconds per phase since :meth:`start`."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._compile_at_start = compile_parts()
        self.last = ""
        """The phase of the latest lap ("" after :meth:`start` or :meth:`skip`)."""
        self.mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the last lap (or :meth:`start`) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.mark
        self.mark = now
        self.last = phase

    def skip(self) -> None:
        """Count the time since the last lap as no phase's (it lands in "other")."""
        self.mark = time.perf_counter()
        self.last = ""

    def _compiled(self) -> dict[str, float]:
        """Compile seconds since :meth:`start`, by phase."""
        now = compile_parts()
        return {p: max(0.0, now[p] - self._compile_at_start.get(p, 0.0)) for p in now}

    def breakdown(self, runtime: float, steps: int, race_seconds: float) -> dict[str, Any]:
        """The run's split in seconds and the step's in ms per step (``steps`` optimizer steps in ``runtime``
        seconds of run); "other" is what no phase claimed (the loop itself, the scheduler, events between)."""
        s = dict(self.seconds)
        compiled = self._compiled()
        spill = 0.0  # compile time beyond its phase's (an unsplit training_step holds both)
        for phase, c in compiled.items():
            taken = min(s.get(phase, 0.0), c)
            s[phase] = s.get(phase, 0.0) - taken
            spill += c - taken
        phases = list(STEP_PHASES) + ([UNSPLIT] if s.get(UNSPLIT, 0.0) > 0 else [])
        if UNSPLIT in phases:
            s[UNSPLIT] = max(0.0, s[UNSPLIT] - spill)
        compile_total = sum(compiled.values())
        # an aside race (the shortest runs) is not a training step; an in-run race's trials are
        training = max(
            0.0, runtime - s.get("evaluation", 0.0) - s.get("save", 0.0) - s.get("race", 0.0) - compile_total
        )
        per_step = {p: s.get(p, 0.0) for p in phases}
        per_step["other"] = max(0.0, training - sum(per_step.values()))
        n = max(1, steps)
        per_step_ms = {p: round(1000 * v / n, 3) for p, v in per_step.items()}
        return {
            "run_seconds": {
                "training_steps": round(training, 3),
                "evaluation": round(s.get("evaluation", 0.0), 3),
                "save": round(s.get("save", 0.0), 3),
                "compile": round(compile_total, 3),
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
