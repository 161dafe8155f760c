"""Peak memory of a piece of training work, measured so that different precisions (or loops) compare.

``measure_run(prepare, device)`` calls ``prepare()`` (uncounted: it may load data or a pristine model) and
measures the ``run`` callable it returns: the peak during ``run()`` above the level just before it.

- CUDA: ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` before ``run()``. The caching
  allocator's counters are exact and resettable. Tensors only: not the allocator's reserve, not the context.
- CPU (Linux): torch keeps no CPU allocator counters, and ``tracemalloc`` sees only Python objects, not
  tensor storage. So: return freed heap pages to the OS (``malloc_trim``), reset the kernel's peak-RSS mark
  (write 5 to /proc/self/clear_refs), read VmRSS, run, read VmHWM. The growth is what the OS had to give
  the work: the model copy, gradients, optimizer state, activations, autocast's cast copies, and allocator
  slack. Run it after a warm-up in the same process: one-time costs (library code paged in on first use,
  oneDNN kernel caches) are then excluded, and they would otherwise dwarf a small model. Measured on the
  built-in "small" GPT: 21-23 MiB in process, 97-103 MiB as the growth of a fresh subprocess.
- Elsewhere (macOS, Windows: no resettable peak RSS) the measurement is refused (None), never guessed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Prepare = Callable[[], Callable[[], Any]]


@dataclass(frozen=True)
class MemoryMeasurement:
    peak_bytes: int
    """Peak above the level just before the measured work."""
    baseline_bytes: int
    """The level before it (resident set of this process, or CUDA bytes allocated)."""
    source: str
    """What was measured, in words."""


CUDA_SOURCE = "cuda: max_memory_allocated during the steps minus memory_allocated before (tensors only)"
CPU_SOURCE = (
    "cpu: growth of this process's peak resident set (VmHWM, reset via /proc/self/clear_refs after "
    "malloc_trim) during the steps, after warm-up"
)


def proc_status_bytes(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), so earlier work's freed memory cannot be reused
    without showing up as new resident pages."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
        ctypes.CDLL(name).malloc_trim(0)


def cpu_memory_supported() -> bool:
    """Whether :func:`measure_run` can measure on a CPU here (a resettable peak RSS: Linux)."""
    return proc_status_bytes("VmHWM") is not None and reset_peak_rss()


def measure_run(prepare: Prepare, device: torch.device | str) -> MemoryMeasurement | None:
    """Peak memory of the ``run`` that ``prepare()`` returns, above the level before it; None where this
    device and OS offer no resettable peak (see the module docstring). Synchronises a CUDA device."""
    device = torch.device(device)
    if device.type == "cuda":
        run = prepare()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del run
        torch.cuda.empty_cache()
        return MemoryMeasurement(max(0, peak - baseline), baseline, CUDA_SOURCE)
    if device.type != "cpu" or not cpu_memory_supported():
        return None
    run = prepare()
    gc.collect()
    _trim_heap()
    reset_peak_rss()
    baseline = proc_status_bytes("VmRSS") or 0
    run()
    peak = proc_status_bytes("VmHWM") or 0
    del run
    gc.collect()
    return MemoryMeasurement(max(0, peak - baseline), baseline, CPU_SOURCE)
