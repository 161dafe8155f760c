"""Where a run's time goes (issue 36): host wall time per phase of the training loop, summed over the run.

The loop marks the end of each phase with :meth:`PhaseClock.lap` (one ``perf_counter`` call, ~0.1 us; no host
sync, nothing on the device). The summary reads it as the run's split (training steps, evaluations, saves,
compile, auto's race) and the step's (data, forward+backward, clip, optimizer, callbacks and logging, the
rest) in ms per step.

What the figures mean depends on the device. On a CPU the kernels run on the calling thread, so each phase is
its compute plus its Python. On a GPU the kernels queue asynchronously: a phase is the host time it took to
launch them, and the wait lands on whichever phase synchronises next (the logging steps' loss read, the fp16
inf check in the optimizer step). Either way, data + callbacks/logging + the rest is what the loop adds around
the model and optimizer: the host overhead compared with a hand-written loop (benchmarks/bench_overhead.py).

Compile time is torch.compile's own (dynamo, AOT and inductor, forward and the lazily compiled backward), read
from dynamo's counters; it is spent inside the first steps' forward+backward and is taken out of it here, so
the step figures are the compiled step's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

STEP_PHASES = ("data", "forward_backward", "clip", "optimizer", "callbacks_logging")
"""A step's phases, in the order they run."""
HOST_OVERHEAD = ("data", "callbacks_logging", "other")
"""The phases a hand-written loop would not have (or would have as little of)."""


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
        self._compile_at_start = compile_seconds()
        self.mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the last lap (or :meth:`start`) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.mark
        self.mark = now

    def skip(self) -> None:
        """Count the time since the last lap as no phase's (it lands in "other")."""
        self.mark = time.perf_counter()

    def breakdown(self, runtime: float, steps: int, race_seconds: float) -> dict[str, Any]:
        """The run's split in seconds and the step's in ms per step (``steps`` optimizer steps in ``runtime``
        seconds of run); "other" is what no phase claimed (the loop itself, the scheduler, events between)."""
        s = self.seconds
        compiled = max(0.0, compile_seconds() - self._compile_at_start)
        fb = max(0.0, s["forward_backward"] - compiled)
        # an aside race (the shortest runs) is not a training step; an in-run race's trials are
        training = max(0.0, runtime - s["evaluation"] - s["save"] - s["race"] - compiled)
        known = fb + sum(s[p] for p in STEP_PHASES if p != "forward_backward")
        per_step = {p: (fb if p == "forward_backward" else s[p]) for p in STEP_PHASES}
        per_step["other"] = max(0.0, training - known)
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
    names = {"forward_backward": "forward+backward", "callbacks_logging": "callbacks/logging"}
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
