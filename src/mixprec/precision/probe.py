"""The speed probe behind precision="auto" on a CPU.

A bare matmul says little about a training step: on CPUs without AMX, fp16 GEMMs can beat fp32 while a
whole fp16 step (autocast casts, fp32 master weights, elementwise ops, backward) is no faster, and bf16 is
slower. So the probe times what a step does: forward and backward through linear layers, an activation and
a norm, with the casts autocast adds. It costs a fraction of a second on a quiet machine and is cached for
the process.

A low-precision mode must win by the median step time and by the best (minimum) one. On a busy machine the
median alone misleads: fp32's short multi-threaded GEMMs lose far more to descheduled OpenMP threads than
the long emulated fp16/bf16 steps do, so the ratio shrinks toward 1 and noise can flip it (on the 2-core dev
box at load average 7, the median-only probe chose bf16 in 2 of 3 runs although bf16 steps cost ~5x fp32's
at one thread there). Noise only ever adds time, so the minimum is the best estimate of what the hardware
does; requiring both keeps the choice "fastest" in the typical and in the undisturbed case.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

# Probe shape: big enough that GEMMs dominate as in a real step, small enough to stay well under a second.
_BATCH, _WIDTH, _HIDDEN = 64, 256, 512
_ROUNDS = 5
# A mode whose best time is this much slower than fp32's best cannot win: stop timing it (keeps the probe
# cheap on CPUs where low precision is emulated and an order of magnitude slower).
_DROP_RATIO = 1.5
# A low-precision mode must beat fp32 by this much to be chosen: ties go to the numerically safer mode.
MARGIN = 0.05

_cache: dict[tuple[str, int], ProbeResult] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class ProbeResult:
    """Median (and minimum) seconds per probe step for each mode, the chosen mode, and what the probe cost."""

    step_seconds: dict[str, float]
    chosen: str
    cost_seconds: float
    threads: int = field(default=1)
    best_seconds: dict[str, float] = field(default_factory=dict)

    def speedups(self) -> dict[str, float]:
        base = self.step_seconds["fp32"]
        return {name: base / t for name, t in self.step_seconds.items()}

    def explain(self) -> str:
        parts = ", ".join(f"{name} {s:.2f}x" for name, s in self.speedups().items())
        return (
            f"auto on cpu measured a training-step probe (speed vs fp32: {parts}; "
            f"probe took {self.cost_seconds:.2f}s) and chose {self.chosen}"
        )


def _probe_model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(_WIDTH, _HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(_HIDDEN, _WIDTH),
        torch.nn.LayerNorm(_WIDTH),
        torch.nn.Linear(_WIDTH, _WIDTH),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _step(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> None:
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
        out = model(x)
    loss = out.float().square().mean()
    loss.backward()


def measure_cpu() -> ProbeResult:
    """Time fp32, bf16 and fp16 probe steps in interleaved rounds and choose the fastest (uncached)."""
    start = time.perf_counter()
    model = _probe_model()
    x = torch.randn(_BATCH, _WIDTH, generator=torch.Generator().manual_seed(1))
    modes: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for dtype in modes.values():  # warm-up: first calls pay for kernel selection and allocation
        _step(model, x, dtype)
    racing = dict(modes)
    for _ in range(_ROUNDS):  # interleaved, so a noisy neighbour hurts every mode alike
        for name, dtype in racing.items():
            t0 = time.perf_counter()
            _step(model, x, dtype)
            samples[name].append(time.perf_counter() - t0)
        # After every round, not only the first: on a busy machine one fp32 sample can be inflated enough to
        # keep a mode racing that its best time already rules out (the probe then cost 5-9 s, not 0.5).
        fp32 = min(samples["fp32"])
        racing = {n: d for n, d in racing.items() if min(samples[n]) <= fp32 * _DROP_RATIO}
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    minima = {name: min(ts) for name, ts in samples.items()}
    chosen = choose(medians, minima)
    return ProbeResult(medians, chosen, time.perf_counter() - start, torch.get_num_threads(), minima)


def choose(step_seconds: dict[str, float], best_seconds: dict[str, float] | None = None) -> str:
    """fp32 unless a low-precision mode is at least ``MARGIN`` faster by the median times (and, when given,
    by the minimum times too); bf16 wins ties with fp16 because it needs no loss scaling."""
    measures = [step_seconds] if best_seconds is None else [step_seconds, best_seconds]
    best = "fp32"
    for name in ("bf16", "fp16"):
        if all(seconds[name] < seconds[best] * (1 - MARGIN) for seconds in measures):
            best = name
    return best


def cpu_probe() -> ProbeResult:
    """The cached probe result for this process (keyed by thread count, which changes the answer)."""
    key = ("cpu", torch.get_num_threads())
    with _lock:
        if key not in _cache:
            _cache[key] = measure_cpu()
        return _cache[key]
