"""Wall-clock timing of steps: ``perf_counter`` on a CPU, CUDA events on a GPU.

A CUDA kernel launch returns before the kernel runs, so host clocks around a step measure the launch, not the
work. :class:`CudaTimer` records an event pair per step on the current stream and synchronises once, when
the times are read, so timing adds no sync inside a round.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


class CpuTimer:
    """Times intervals with ``time.perf_counter``. On a CPU every op is synchronous, so this is the work."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._times: list[float] = []

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            raise RuntimeError("CpuTimer.stop() called before start()")
        self._times.append(time.perf_counter() - self._start)
        self._start = None

    def times(self) -> list[float]:
        """Seconds of each start/stop interval so far."""
        return list(self._times)


class CudaTimer:
    """Times intervals with CUDA events on the current stream. ``times()`` synchronises (one host sync for
    all intervals); ``start``/``stop`` only enqueue events and never sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: torch.cuda.Event | None = None
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        self._pending = torch.cuda.Event(enable_timing=True)
        self._pending.record()

    def stop(self) -> None:
        if self._pending is None:
            raise RuntimeError("CudaTimer.stop() called before start()")
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pairs.append((self._pending, end))
        self._pending = None

    def times(self) -> list[float]:
        """Seconds of each interval (synchronises the device once)."""
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1000.0 for start, end in self._pairs]


def make_timer(device: torch.device) -> CpuTimer | CudaTimer:
    """The right timer for ``device``: CUDA events on a GPU, ``perf_counter`` elsewhere."""
    return CudaTimer(device) if device.type == "cuda" else CpuTimer()


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Summary:
    """Median and spread of a list of step times."""

    median: float
    q1: float
    q3: float
    minimum: float
    maximum: float
    count: int

    @property
    def spread(self) -> float:
        """Interquartile range (q3 - q1): robust to the one step a neighbour's job slowed down."""
        return self.q3 - self.q1


def summarize(times: list[float]) -> Summary:
    """Median, quartiles (inclusive method: defined for any count >= 1), min and max of ``times``."""
    if not times:
        raise ValueError("summarize() needs at least one time")
    if len(times) == 1:
        q1 = q3 = times[0]
    else:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Summary(statistics.median(times), q1, q3, min(times), max(times), len(times))
