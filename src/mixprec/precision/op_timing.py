"""Measure each op kind's low-precision kernel against fp32 on the shapes a model really runs (issue 23).

One forward under autocast records every call of a policy's op kinds (function, argument shapes, strides,
dtypes, the non-tensor arguments); identical calls are timed once and counted (a 12-layer model's layers
are one entry). Each entry is then replayed forward+backward two ways, interleaved round by round:

- ``low``: under ``torch.autocast`` with the inputs in the dtypes it received them in, casts included —
  what the kind costs when a policy leaves it to autocast;
- ``fp32``: autocast off, inputs cast to fp32 — what :class:`~mixprec.precision.op_policy.Fp32Regions`
  runs. A kind whose fp32 time beats its low one by ``margin`` is kept in fp32; a tie stays with autocast.
  The result is a policy name ("bf16:fp32_ops=attention") and a report of both timings per kind.

Bounded: replays stop at ``budget_s`` (after at least one timed round each); inputs are random tensors of
the recorded layout (the kernels' speed does not depend on the values), integer inputs (indices, labels)
are the recorded ones. Costs one forward of the model plus the replays, with a host sync per timing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from mixprec.precision.base import Precision
from mixprec.precision.op_policy import OP_KINDS, OpPolicy, kind_of
from mixprec.precision.policy import POLICY_BASES, make_policy, recomputes_activations
from mixprec.precision.race import BUDGET_SHARE
from mixprec.precision.trial import synchronize

# fp32 must be 5% faster than the low-precision kernel to be forced: a kind within the noise stays as autocast
# runs it (torch's own choice), so a policy changes autocast only where the measurement shows a win (on the
# main job, norm's 4.5 vs 4.2 ms tie put in fp32 made the whole step slower, not faster).
MARGIN = 0.05
MATERIAL = 0.02  # a kind moves to fp32 only if that saves at least this share of the step's op time
DOMINATED = 0.15  # the base mode is not raced against its policy when the policy saves this share of its op time
_MAX_ROUNDS = 7
# Per-op-kind timing before the race (issue 23): its replays get OP_TIMING_BUDGET_S at most, and at most
# OP_TIMING_SHARE of the run when its length is known (auto.py)
OP_TIMING_BUDGET_S = 1.5
OP_TIMING_SHARE = 0.01
SETUP_NEGLIGIBLE_S = 0.05  # a replay this long counts even as its kernel's first call (setup is small beside it)


@dataclasses.dataclass(frozen=True)
class _Meta:
    """A floating tensor argument, by layout only."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    grad: bool = True  # it needed a gradient in the recorded forward (weights, activations; not running stats)


@dataclasses.dataclass
class _Call:
    func: Any
    kind: str
    args: Any  # pytree of _Meta / integer tensors / plain values
    count: int = 1


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, _Call] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = kind_of(func)
        if kind is not None:
            packed = pytree.tree_map_only(torch.Tensor, _pack, (args, kwargs))
            key = f"{kind}|{getattr(func, '__name__', func)}|{packed!r}"
            if key in self.calls:
                self.calls[key].count += 1
            else:
                self.calls[key] = _Call(func, kind, packed)
        return func(*args, **kwargs)


def _pack(t: torch.Tensor) -> Any:
    if t.is_floating_point():
        return _Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)
    return t.detach().clone()  # indices, labels, masks: their values decide what the kernel does


def _unpack(x: Any) -> Any:
    if isinstance(x, _Meta):
        # uniform, not normal: values do not change these kernels' speed, and it fills 2x faster (GPT-2's vocab)
        t = torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=x.device).uniform_(-1, 1)
        return t.requires_grad_(x.grad)
    return x


@dataclasses.dataclass(frozen=True)
class KindTiming:
    """One op kind: forward+backward milliseconds per step (all its calls) in low precision and in fp32."""

    kind: str
    calls: int
    low_ms: float
    fp32_ms: float

    def choice(self, margin: float = MARGIN) -> str:
        """ "fp32" when fp32 beats low precision by ``margin``, else "low" (autocast's own choice on a tie)."""
        return "fp32" if self.fp32_ms < self.low_ms * (1.0 - margin) else "low"


@dataclasses.dataclass(frozen=True)
class OpTimingReport:
    """What :func:`measure_op_kinds` measured and the policy it builds."""

    base: str
    device: str
    timings: tuple[KindTiming, ...]
    policy: str
    """The precision name to race: the base mode itself when every measured kind is faster in it."""
    elapsed_s: float
    margin: float = MARGIN

    def base_dominated(self) -> str:
        """Why the base mode need not race against its own policy, or "" where it must. The policy is the base
        with the kinds :func:`fp32_kinds` names moved to fp32; when those kinds cost the base ``DOMINATED`` of its
        op time more than they cost in fp32, no cast the policy adds at their edges comes near that, so racing the
        base as well only spends steps (issue 36: on the main job, bf16's attention at 47.6 ms against 25.2 ms in
        fp32, 24% of the step; its 4 race steps and their replay were a third of the race)."""
        fp32 = fp32_kinds(self.timings, self.margin)
        total = sum(t.low_ms for t in self.timings)
        low = sum(t.low_ms for t in self.timings if t.kind in fp32)
        high = sum(t.fp32_ms for t in self.timings if t.kind in fp32)
        if not fp32 or total <= 0 or low - high < DOMINATED * total:
            return ""
        return (
            f"the per-op-kind timing put its {', '.join(sorted(fp32))} at {low:.1f} ms against {high:.1f} ms in fp32 "
            f"({(low - high) / total:.0%} of its op time), so {self.policy} raced in its place"
        )

    def explain(self) -> str:
        """A table: each op kind's two timings and the choice, then the policy."""
        lines = [f"per-op-kind timing on {self.device} ({self.elapsed_s:.2f} s; forward+backward ms per step)"]
        lines.append(f"  {'op kind':<11}{'calls':>6}{self.base + ' ms':>11}{'fp32 ms':>10}  choice")
        fp32 = fp32_kinds(self.timings, self.margin)
        for t in self.timings:
            choice = "fp32" if t.kind in fp32 else self.base
            if t.kind not in fp32 and t.choice(self.margin) == "fp32":
                choice += f" (fp32 would save < {MATERIAL:.0%} of the step)"
            lines.append(f"  {t.kind:<11}{t.calls:>6}{t.low_ms:>11.2f}{t.fp32_ms:>10.2f}  {choice}")
        lines.append(f"  policy: {self.policy}")
        return "\n".join(lines)


def fp32_kinds(timings: list[KindTiming] | tuple[KindTiming, ...], margin: float = MARGIN) -> frozenset[str]:
    """The kinds worth holding in fp32: fp32 beats low precision by ``margin`` *and* the saving is at least
    ``MATERIAL`` of the step's op time. A kind of a few hundred microseconds (embedding, softmax, norm on the
    main job) flips between the two on noise alone, and fresh races then named different policies of the same
    speed (benchmarks/README.md: 6/10 agreed on the exact name before this rule)."""
    total = sum(t.low_ms for t in timings)
    return frozenset(t.kind for t in timings if t.choice(margin) == "fp32" and t.low_ms - t.fp32_ms >= MATERIAL * total)


def policy_from_timings(base: str, timings: list[KindTiming] | tuple[KindTiming, ...], margin: float = MARGIN) -> str:
    """The precision name the measured winners make: ``base`` with every kind :func:`fp32_kinds` names kept in
    fp32; ``base`` alone when there is none. Kinds not measured (the model does not call them) stay as
    autocast runs them."""
    fp32 = fp32_kinds(timings, margin)
    return OpPolicy(base, fp32).spec if fp32 else base


def measure_op_kinds(
    forward: Callable[[], Any],
    device: torch.device | str,
    base: str = "bf16",
    *,
    budget_s: float | Callable[[float], float] = 2.0,
    margin: float = MARGIN,
    clock: Callable[[], float] = time.perf_counter,
) -> OpTimingReport:
    """Time each op kind ``forward`` calls, in ``base``'s dtype against fp32, and build the policy.

    ``forward`` runs the model's forward on a real batch (the race's ``loss_fn``); it is called once, under
    autocast, to record the calls. It may touch buffers or the RNG: call this where
    such state is restored (the race's ``no_trace``). ``budget_s`` bounds the replays (each call is timed
    at least once per variant), or gives the bound from the recording forward's seconds (a callable). A
    call's first replay warms its kernels up; one longer than ``SETUP_NEGLIGIBLE_S`` is a sample too (what
    setup it paid is small beside it: GPT-2's 768 x 50257 output layer on a CPU). Raises ValueError for a
    ``base`` without autocast ("bf16" or "fp16").
    """
    if base not in POLICY_BASES:
        raise ValueError(f"measure_op_kinds(base={base!r}): choose one of {', '.join(POLICY_BASES)}")
    dev = torch.device(device)
    low = POLICY_BASES[base].compute_dtype
    start = clock()
    recorder = _Recorder()
    # with grad, so each argument's requires_grad says what the replays' backward differentiates (a norm's
    # running statistics must not); the recorded graph is dropped at once
    synchronize(dev)
    with torch.autocast(dev.type, dtype=low), recorder:
        forward()
    synchronize(dev)
    calls = list(recorder.calls.values())
    samples: dict[int, dict[str, list[float]]] = {i: {"low": [], "fp32": []} for i in range(len(calls))}
    deadline = start + (budget_s(clock() - start) if callable(budget_s) else budget_s)
    # one set of inputs per call, reused by its replays: filling GPT-2's 50257 x 768 weights with random
    # numbers took longer than the replays themselves
    inputs = [_inputs(call) for call in calls]
    for i, call in enumerate(calls):  # warm-up: the first call of a kernel pays for its setup
        for variant in ("low", "fp32"):
            if (took := _timed(call, inputs[i], variant, dev, low, clock)) >= SETUP_NEGLIGIBLE_S:
                samples[i][variant].append(took)
    for round_ in range(_MAX_ROUNDS):
        for i, call in enumerate(calls):
            if clock() > deadline and samples[i]["low"] and samples[i]["fp32"]:
                continue  # out of time: only calls without a sample yet
            for variant in ("low", "fp32") if round_ % 2 == 0 else ("fp32", "low"):  # rotate the order
                samples[i][variant].append(_timed(call, inputs[i], variant, dev, low, clock))
        if clock() > deadline:
            break
    per_kind: dict[str, list[float]] = {}
    for i, call in enumerate(calls):
        acc = per_kind.setdefault(call.kind, [0, 0.0, 0.0])
        acc[0] += call.count
        acc[1] += call.count * statistics.median(samples[i]["low"]) * 1e3
        acc[2] += call.count * statistics.median(samples[i]["fp32"]) * 1e3
    timings = tuple(KindTiming(k, int(v[0]), v[1], v[2]) for k in OP_KINDS if (v := per_kind.get(k)) is not None)
    return OpTimingReport(
        base=base,
        device=str(dev),
        timings=timings,
        policy=policy_from_timings(base, timings, margin),
        elapsed_s=clock() - start,
        margin=margin,
    )


def _inputs(call: _Call) -> Any:
    """Fresh leaves of the recorded layout (made outside the timed region: filling them is not the op's)."""
    return pytree.tree_map(_unpack, call.args, is_leaf=lambda x: isinstance(x, _Meta))


def _replay(call: _Call, inputs: Any, variant: str, device: torch.device, low: torch.dtype) -> None:
    args, kwargs = inputs
    if variant == "fp32":  # what Fp32Regions does, the casts included
        args, kwargs = pytree.tree_map_only(torch.Tensor, _fp32, (args, kwargs))
    with torch.autocast(device.type, dtype=low, enabled=variant == "low"):
        out = call.func(*args, **kwargs)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


def _timed(
    call: _Call, inputs: Any, variant: str, device: torch.device, low: torch.dtype, clock: Callable[[], float]
) -> float:
    for leaf in pytree.tree_leaves(inputs):  # each replay's backward writes its gradients afresh, as the first
        if isinstance(leaf, torch.Tensor):
            leaf.grad = None
    synchronize(device)
    t0 = clock()
    _replay(call, inputs, variant, device, low)
    synchronize(device)
    return clock() - t0


def policy_candidate(report: OpTimingReport, device: torch.device | str) -> Precision | None:
    """The measured policy as a strategy for "auto"'s race (its whole-step confirmation against the uniform
    modes), with the report in its ``reason``; None when the policy is the base mode itself (already a
    candidate)."""
    if report.policy == report.base:
        return None
    candidate = make_policy(report.policy, device)
    candidate.reason = f"per-op-kind timing: {report.policy} ({report.elapsed_s:.2f} s)"
    return candidate


# The timing's shortest course: the recording forward, then a warm-up and a timed replay of every call in both
# precisions, about this many forward+backward passes of the step (the example of issue 36: 1.3-2.4 s, 5-9
# bf16 steps)
SHORTEST_PASSES = 6


def op_timing_skipped(run_steps: int | None, models: Sequence[torch.nn.Module] = ()) -> str:
    """Why a run of ``run_steps`` forward+backward passes does not time its op kinds, or "" where it does (its
    length unknown included): its shortest course (``SHORTEST_PASSES``) must fit in the race's budget share of
    the run (race.py's ``BUDGET_SHARE``), the most auto may spend measuring (issue 36: on a 60-step run the
    timing alone took 9% of the run, for a policy that came out uniform bf16). Nor where one of ``models``
    recomputes its activations in backward (gradient checkpointing): the recompute does not run a policy's
    fp32 regions, so no policy could train it (policy.py refuses it), and racing one crashed the run."""
    if any(recomputes_activations(m) for m in models):
        return (
            "per-op-kind timing skipped: the model recomputes its activations in backward (gradient "
            "checkpointing), where a per-op policy's fp32 regions do not hold; the uniform modes race"
        )
    if run_steps is None or SHORTEST_PASSES <= BUDGET_SHARE * run_steps:
        return ""
    return (
        f"per-op-kind timing skipped: its shortest course (~{SHORTEST_PASSES} passes of the step) would cost "
        f"over {BUDGET_SHARE:.0%} of this {run_steps}-pass run; the uniform modes race"
    )


def op_timing_budget(run_steps: int | None) -> Callable[[float], float]:
    """How long the per-op-kind replays may take, from the recording forward's seconds: ``OP_TIMING_BUDGET_S``,
    and at most ``OP_TIMING_SHARE`` of the run when its length (forward+backward passes) is known, a pass
    estimated as three forwards."""

    def budget(forward_s: float) -> float:
        if run_steps is None:
            return OP_TIMING_BUDGET_S
        return min(OP_TIMING_BUDGET_S, OP_TIMING_SHARE * run_steps * 3 * forward_s)

    return budget
