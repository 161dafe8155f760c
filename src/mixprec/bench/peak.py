"""The measured matmul peak of one dtype on one device: the denominator of MFU.

Datasheet peaks do not exist for most CPUs and are rarely reached on GPUs, so MFU here is against what a
large square matmul of the *same dtype* actually does on this machine, at this thread count, right now
(on a shared machine that includes the neighbours). It makes fp16 and bf16 on a CPU without native support
comparable: their peak is as low as their step is slow.

The matmul is ``F.linear`` (what ``nn.Linear`` runs), not ``torch.mm``: on CPUs without native bf16/fp16
they take different kernels (oneDNN vs a generic loop), up to 10x apart, and a training step's FLOPs are
in its Linear layers. Every dtype is timed the same way: square sizes doubling from 256 to the device's cap,
the same repeats of each, and the best FLOP/s over every size and repeat is kept (noise only ever adds
time). (Stopping early once a matmul took long enough timed fp32 at 512 and bf16 at 1024 on a CPU, so the
fastest mode's row showed the lowest MFU: issue 29.) A model's own GEMMs can still
beat it now and then (smaller shapes stay in cache), so an MFU a little above 100% means "at the peak".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_START_SIZE = 256
_MAX_SIZE = {"cuda": 8192, "cpu": 1024}


@dataclass(frozen=True)
class PeakFlops:
    """Best FLOP/s of a ``size`` x ``size`` matmul in ``dtype``, and a sentence saying so."""

    dtype: str
    flops_per_s: float
    size: int
    repeats: int
    device: str

    @property
    def source(self) -> str:
        return (
            f"measured at start: best {self.dtype} {self.size}x{self.size} matmul (F.linear) on {self.device}, "
            f"{self.flops_per_s / 1e9:,.1f} GFLOP/s"
        )


def _time_linear(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        F.linear(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    F.linear(a, b)
    return time.perf_counter() - t0


def measure_peak_flops(dtype: torch.dtype, device: torch.device | str, *, repeats: int = 3) -> PeakFlops:
    """Time square matmuls of ``dtype`` on ``device``; return the best FLOP/s seen (2 n^3 per matmul).

    Costs about a second per dtype on a CPU (several for a dtype it emulates) and milliseconds on a GPU.
    Synchronises the device.
    """
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    best_rate, best_size, size = 0.0, _START_SIZE, _START_SIZE
    while True:
        # made on the device: an 8192^2 randn on the host would cost more than all the GPU timing
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        _time_linear(a, b, device)  # the first call at a size pays for kernel selection
        seconds = [_time_linear(a, b, device) for _ in range(repeats)]
        rate = 2.0 * size**3 / max(min(seconds), 1e-12)
        if rate > best_rate:
            best_rate, best_size = rate, size
        if size * 2 > _MAX_SIZE[kind]:
            break
        size *= 2
    name = str(dtype).removeprefix("torch.")
    where = f"cuda ({torch.cuda.get_device_name(device)})" if kind == "cuda" else device.type
    return PeakFlops(name, best_rate, best_size, repeats, where)
