"""How many torch threads ``mixprec train`` uses: the cores free when it starts, not the cores there are.

torch's default is one intra-op thread per core. On a machine other work also uses, that is a trap: an
OpenMP thread that waits for a core holds up the others at every parallel region's barrier (issue 29: the
default job took 3 min 26 s with 2 threads on 2 busy cores, 24.8 s on the quiet machine). The rule, written
once and measured both ways in benchmarks/README.md: sample the whole machine's busy time over
``SAMPLE_SECONDS`` (/proc/stat, before this process does any work), and use the cores left free, rounded,
at least one and at most torch's default. ``OMP_NUM_THREADS`` (or ``torch.set_num_threads`` by a caller)
wins over the rule; where /proc/stat cannot be read, torch's default stays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

SAMPLE_SECONDS = 0.3


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str

    def describe(self) -> str:
        return f"{self.threads} torch thread{'s' if self.threads != 1 else ''} ({self.why})"


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores' worth of work the machine did over the next ``seconds`` (this process sleeps meanwhile, so it
    is other processes' work). None where /proc/stat cannot be read."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def choose_threads(
    environ: Mapping[str, str] | None = None, measure: Callable[[], float | None] = busy_cores
) -> ThreadChoice:
    """The threads for this run (see the module docstring); ``measure`` returns the busy cores (tests plant
    it). Costs ``SAMPLE_SECONDS`` of sleep when measuring."""
    env = os.environ if environ is None else environ
    default = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if env.get("OMP_NUM_THREADS"):
        return ThreadChoice(default, "OMP_NUM_THREADS")
    busy = measure()
    if busy is None:
        return ThreadChoice(default, "torch's default: the machine's load could not be read")
    threads = max(1, min(default, round(cores - busy)))
    return ThreadChoice(
        threads,
        f"{cores} core{'s' if cores != 1 else ''}, {busy:.1f} busy with other work at start; OMP_NUM_THREADS sets it",
    )
