"""The stand-in speed probe: what a bare ``resolve_precision("auto")`` guesses with on a CPU.

Where a training step exists (the Accelerator, the Trainer, ``mixprec train``, ``mixprec bench``), "auto"
races the candidates on that step instead (:mod:`mixprec.precision.race`); this probe only serves a call
that has no step to measure, and the reason it gives says that it guessed.

A bare matmul says little about a training step: on CPUs without AMX, fp16 GEMMs can beat fp32 while a
whole fp16 step (autocast casts, fp32 master weights, elementwise ops, backward) is no faster, and bf16 is
slower. So the probe times what a language-model step does: one transformer block and a vocabulary head,
forward and backward, with the casts autocast adds. It costs about half a second and is cached for the
process.

It runs on one thread: what a dtype changes is the per-core kernel (native AMX/AVX512-BF16 or emulated), and
on a busy machine short multi-threaded fp32 ops lose far more to descheduled OpenMP threads than long emulated
fp16/bf16 ones (at load average 7, a 2-thread probe measured bf16 1.4x *faster* than fp32; the real model's
bf16 steps were 1.6x slower). A low-precision mode must win by the median step time and by the best (minimum)
one: noise only ever adds time.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mixprec.precision import race

if TYPE_CHECKING:
    from mixprec.precision.base import Precision

# Probe shape: big enough that GEMMs dominate as in a real step, small enough to stay well under a second.
_BATCH, _SEQ, _WIDTH, _HIDDEN, _HEADS, _VOCAB = 2, 32, 128, 512, 4, 256
_ROUNDS = 5
# A mode whose best time is this much slower than fp32's best cannot win: stop timing it (keeps the probe
# cheap on CPUs where low precision is emulated and an order of magnitude slower).
_DROP_RATIO = 1.5
MARGIN = race.MARGIN  # a low-precision mode must beat fp32 by this much: ties go to the safer mode

# Before a race on a CPU: a dtype whose GEMMs run this much slower than fp32's is emulated here (fp16 without
# AVX512-FP16: 14-23x on the Zen 4 box; native bf16 there: 0.4x at this shape, 1.1x at a tiny one), and one
# trial of it on a large model can sit a minute inside a single kernel that no deadline interrupts (issue 23:
# GPT-2 124M). The shape is a transformer layer's GEMM at a few hundred tokens: at the one-block probe's tiny
# shape native bf16 measured 5.5x fp32 (fixed costs), so that probe cannot tell emulation from overhead.
PREFILTER_RATIO = 5.0
_GEMM = (256, 512, 512)
_gemm_cache: dict[torch.dtype, float] = {}

_cache: dict[tuple[str, int], ProbeResult] = {}  # (device type, threads)
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


class _ProbeBlock(torch.nn.Module):
    """One pre-LN transformer block and a vocabulary head: the op mix of a real language-model step
    (GEMMs, attention, norms, GELU, softmax cross-entropy). An MLP alone misleads: its GEMMs can favour
    bf16 while attention, norms and casts make the whole step slower."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(_WIDTH)
        self.qkv = torch.nn.Linear(_WIDTH, 3 * _WIDTH)
        self.proj = torch.nn.Linear(_WIDTH, _WIDTH)
        self.ln2 = torch.nn.LayerNorm(_WIDTH)
        self.fc = torch.nn.Linear(_WIDTH, _HIDDEN)
        self.out = torch.nn.Linear(_HIDDEN, _WIDTH)
        self.head = torch.nn.Linear(_WIDTH, _VOCAB)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, _HEADS, c // _HEADS).transpose(1, 2) for z in (q, k, v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        x = x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, _VOCAB), targets.view(-1))


def _probe_model() -> torch.nn.Module:
    torch_state = torch.random.get_rng_state()
    try:  # the probe must not move the user's RNG stream (bit-exact resume depends on it)
        torch.manual_seed(0)
        return _ProbeBlock()
    finally:
        torch.random.set_rng_state(torch_state)


def _step(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None) -> None:
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
        loss = model(x, targets)
    loss.backward()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread (see the module docstring: per-core speed, immune to neighbours' load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@_one_thread()
def measure_cpu() -> ProbeResult:
    """Time fp32, bf16 and fp16 probe steps in interleaved rounds and choose the fastest (uncached)."""
    start = time.perf_counter()
    model = _probe_model()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(_BATCH, _SEQ, _WIDTH, generator=g)
    targets = torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=g)
    modes: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for dtype in modes.values():  # warm-up: first calls pay for kernel selection and allocation
        _step(model, x, targets, dtype)
    racing = dict(modes)
    for _ in range(_ROUNDS):  # interleaved, so a noisy neighbour hurts every mode alike
        for name, dtype in racing.items():
            t0 = time.perf_counter()
            _step(model, x, targets, dtype)
            samples[name].append(time.perf_counter() - t0)
        # After every round, not only the first: on a busy machine one fp32 sample can be inflated enough to
        # keep a mode racing that its best time already rules out (the probe then cost 5-9 s, not 0.5).
        fp32 = min(samples["fp32"])
        racing = {n: d for n, d in racing.items() if min(samples[n]) <= fp32 * _DROP_RATIO}
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    minima = {name: min(ts) for name, ts in samples.items()}
    chosen = choose(medians, minima)
    return ProbeResult(medians, chosen, time.perf_counter() - start, 1, minima)


def choose(step_seconds: dict[str, float], best_seconds: dict[str, float] | None = None) -> str:
    """fp32 unless a low-precision mode is at least ``MARGIN`` faster by the median times (and, when given,
    not slower by the minimum times); bf16 wins ties with fp16 because it needs no loss scaling. The rule of
    :func:`mixprec.precision.race.choose`, the one both the probe and the real race use."""
    return race.choose(("fp32", "bf16", "fp16"), step_seconds, best_seconds or step_seconds)


def cpu_probe() -> ProbeResult:
    """The cached probe result for this process."""
    key = ("cpu", 1)
    with _lock:
        if key not in _cache:
            _cache[key] = measure_cpu()
        return _cache[key]


def gemm_ratio(dtype: torch.dtype) -> float:
    """Best time of a layer's three GEMMs (forward and the two of backward, ``_GEMM``-shaped, one thread) in
    ``dtype`` over fp32's; cached per process. Costs about 0.3 s where ``dtype`` is emulated, ~20 ms where not."""
    with _lock:
        for d in (torch.float32, dtype):
            if d not in _gemm_cache:
                _gemm_cache[d] = _gemm_seconds(d)
        return _gemm_cache[dtype] / _gemm_cache[torch.float32]


@_one_thread()
def _gemm_seconds(dtype: torch.dtype, reps: int = 2) -> float:
    m, k, n = _GEMM
    g = torch.Generator().manual_seed(0)
    a, b, out = (torch.randn(*shape, generator=g).to(dtype) for shape in ((m, k), (k, n), (m, n)))
    times = []
    for _ in range(reps + 1):  # the first pays for packing and allocation
        t0 = time.perf_counter()
        a @ b, a.t() @ out, out @ b.t()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def emulated_candidates(candidates: Sequence[Precision]) -> dict[str, str]:
    """On a CPU, the candidates after the safest whose compute dtype's GEMMs run ``PREFILTER_RATIO`` x fp32's
    time or slower (:func:`gemm_ratio`): name -> why, for the race to leave out before their first trial.
    Nothing on other devices."""
    if not candidates or candidates[0].device.type != "cpu":
        return {}
    out = {}
    for candidate in candidates[1:]:
        dtype = candidate.compute_dtype
        if dtype not in (torch.bfloat16, torch.float16):
            continue
        ratio = gemm_ratio(dtype)
        if ratio >= PREFILTER_RATIO:
            name = str(dtype).removeprefix("torch.")
            out[candidate.name] = (
                f"its {name} matmuls ran {ratio:.1f}x slower than fp32's (emulated on this CPU), so it was not raced"
            )
    return out
