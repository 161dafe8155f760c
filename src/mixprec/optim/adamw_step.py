"""The one Adam(W) step of mixprec's optimizers: ``Bf16AdamW`` (bf16 weights: stochastic rounding or Kahan
summation) and ``AnyPrecisionAdamW`` (HF's ``adamw_anyprecision``: moments stored in any dtype).

Each says, per parameter group, how its parameters are stepped (a :class:`StepRule`); the arithmetic is here,
once. It runs in fp32 over buckets of elements that run across parameters (issue 28: the per-parameter
Python loop made the GPU step 3.3x slower than bf16 autocast's): each bucket is a handful of multi-tensor kernels
(``_foreach_copy_`` in, torch's fused Adam(W) kernel over the list, the rounding on the bucket's flat buffer,
``_foreach_copy_`` out), whatever the number of parameters in it. The copies in and out widen and round: a
moment stored in bf16 is read into fp32, updated there, and rounded to nearest on store, while the update uses
the fp32 value. The fp32 buffers hold one bucket (``bucket_elements``: 2^22 on a GPU, 2^18 on a CPU), never a
copy of the model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.optim.kahan import kahan_update_buckets_
from mixprec.optim.noise import RoundingNoise
from mixprec.optim.rounding import round_stochastically_
from mixprec.shards import local

ROUNDINGS = ("stochastic", "kahan", "nearest")

_CHUNK = 1 << 18  # elements per bucket on a CPU: the scratch is 4 x 1 MiB fp32 (+ 3 MiB noise)
_CUDA_CHUNK = 1 << 22  # on a GPU: 4 x 16 MiB (+ 48 MiB noise); ~30 buckets for GPT-2 124M, ~20 launches each


@dataclass(frozen=True)
class StepRule:
    """How one parameter group is stepped (fp32 parameters ignore ``rounding`` and get no compensation)."""

    decoupled: bool = True
    """AdamW's decay of the weight (True) or Adam's L2 term in the gradient (False)."""
    rounding: str = "nearest"
    """To the parameter's dtype: "nearest", "stochastic" (unbiased), or "kahan" (the loss kept and re-added)."""
    momentum_dtype: torch.dtype | None = None
    """Storage of the first moment; None: the parameter's dtype."""
    variance_dtype: torch.dtype | None = None
    """Storage of the second moment; None: the parameter's dtype."""
    compensation_dtype: torch.dtype | None = None
    """Storage of Kahan's compensation buffer; None: the parameter's dtype."""


class AdamWStep(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step`` is the bucketed Adam(W) step; subclasses define :meth:`rule`.

    Cost: per bucket of elements (across parameters) about 20 kernel launches and no host sync; the buffers are
    kept between steps, so no step allocates (fresh multi-megabyte buffers cost page faults on every CPU step).
    The arithmetic is torch's fused Adam(W) kernel where the device has one (not for Kahan, which needs the
    update on its own); the result does not depend on the bucket size (tests/optim/test_bf16_adamw_buckets.py).
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], bucket_elements: int | None = None) -> None:
        super().__init__(params, defaults)
        self.bucket_elements = bucket_elements
        self._scratch: dict[torch.device, _Scratch] = {}

    def rule(self, group: dict[str, Any]) -> StepRule:
        """How ``group``'s parameters are stepped."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but into the group dicts this optimizer already holds: pure bf16 shares them with the
        optimizer it replaced (``PureBf16Precision.convert_optimizer``), on which the user's LR scheduler was
        built. torch's version puts new dicts in their place, so after a resume the scheduler steered an
        optimizer that no longer steps and the learning rate stayed at the checkpoint's (issue 34's matrix)."""
        groups = self.param_groups
        super().load_state_dict(state_dict)
        for held, loaded in zip(groups, self.param_groups, strict=True):
            held.update(loaded)
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update. No host sync (step counts are host floats)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        keyed: set[torch.device] = set()  # devices whose rounding noise got this step's key
        for group in self.param_groups:
            rule = self.rule(group)
            params = [p for p in group["params"] if p.grad is not None]
            work = {p: p if p.is_contiguous() else p.contiguous() for p in params}  # views need contiguous data
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._init_state(p, rule)
                self.state[p]["step"] += 1
            for key, slices in _buckets(params, self.state, self._limit):
                device, dtype, step = key
                scratch = self._scratch.setdefault(device, _Scratch(device))
                stochastic = rule.rounding == "stochastic" and dtype != torch.float32
                if stochastic and device not in keyed:
                    scratch.noise.reseed()
                    keyed.add(device)
                hyper = _hyper(group, rule, step, device, scratch)
                _update_bucket(slices, work, self.state, hyper, scratch, stochastic)
            for p, w in work.items():
                if w is not p:
                    p.copy_(w)
        return loss

    def _limit(self, device: torch.device) -> int:
        if self.bucket_elements is not None:
            return self.bucket_elements
        return _CUDA_CHUNK if device.type == "cuda" else _CHUNK

    def _init_state(self, p: torch.Tensor, rule: StepRule) -> None:
        state = self.state[p]
        if state:
            return
        contiguous = torch.contiguous_format  # the buckets read flat views
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=rule.momentum_dtype, memory_format=contiguous)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=rule.variance_dtype, memory_format=contiguous)
        if rule.rounding == "kahan" and p.dtype != torch.float32:
            state["compensation"] = torch.zeros_like(p, dtype=rule.compensation_dtype, memory_format=contiguous)


@dataclass(slots=True)
class _Hyper:
    lr: float
    beta1: float
    beta2: float
    wd: float
    decoupled: bool
    rounding: str
    step_size: float
    eps: float
    raw_eps: float
    step_tensor: torch.Tensor
    fused: Any


def _hyper(group: dict[str, Any], rule: StepRule, step: float, device: torch.device, scratch: _Scratch) -> _Hyper:
    beta1, beta2 = group["betas"]
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    # lr * m_hat / (sqrt(v_hat) + eps) with the bias corrections folded into two scalars
    return _Hyper(
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        wd=group["weight_decay"],
        decoupled=rule.decoupled,
        rounding=rule.rounding,
        step_size=group["lr"] * math.sqrt(bias2) / bias1,
        eps=group["eps"] * math.sqrt(bias2),
        raw_eps=group["eps"],
        step_tensor=scratch.step_tensor(step),
        fused=_fused_kernel(device, rule.decoupled, rule.rounding),
    )


class _Scratch:
    """fp32 work buffers (and int32 noise) of one bucket, made on first use, kept between steps; the step
    count as a device scalar (one host-to-device copy per step value, not one per parameter)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.noise = RoundingNoise(device)
        self._step: torch.Tensor | None = None
        self._step_value: float | None = None

    def take(self, n: int) -> tuple[torch.Tensor, ...]:
        if not self.buffers or self.buffers[0].numel() < n:  # as large as the largest bucket seen, no larger
            self.buffers = [torch.empty(n, dtype=torch.float32, device=self.device) for _ in range(4)]
        return tuple(b[:n] for b in self.buffers)

    def step_tensor(self, step: float) -> torch.Tensor:
        """The step count as a 0-d device tensor for the fused kernel. ``fill_`` passes the value as a kernel
        argument: no host-to-device copy, so no sync (a ``.to(device)`` per parameter was one each)."""
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float32, device=self.device)
        if step != self._step_value:
            self._step.fill_(step)  # ordered after the kernels that read the previous value: one stream
            self._step_value = step
        return self._step


@functools.cache
def _fused_kernel(device: torch.device, decoupled: bool, rounding: str) -> Any:
    """torch's fused Adam(W) step for ``device`` (what ``torch.optim.AdamW(fused=True)`` runs), or None where
    torch has none; Kahan summation needs the update on its own, so it keeps the unfused arithmetic."""
    if rounding == "kahan":
        return None
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # an older or newer torch without the helper: the arithmetic below is exact too
        supported = False
    kernel = getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)
    return kernel if supported else None


_Slice = tuple[torch.Tensor, int, int]  # (parameter, start, end) in its flattened elements


def _buckets(
    params: list[torch.Tensor], state: dict, limit_of: Any
) -> Iterator[tuple[tuple[torch.device, torch.dtype, float], list[_Slice]]]:
    """Runs of at most ``limit_of(device)`` elements, in parameter order (the rounding noise is drawn in that
    order, so any bucketing rounds alike), each of one device, dtype and step count; a parameter larger than
    the limit is split across buckets."""
    key: tuple[torch.device, torch.dtype, float] | None = None
    slices: list[_Slice] = []
    size = 0
    for p in params:
        this = (p.device, p.dtype, float(state[p]["step"]))
        limit, numel = limit_of(p.device), local(p).numel()  # FSDP2: this process's shard
        if this != key and slices:
            yield key, slices
            slices, size = [], 0
        key = this
        start = 0
        while start < numel:
            take = min(numel - start, limit - size)
            slices.append((p, start, start + take))
            size += take
            start += take
            if size == limit:
                yield key, slices
                slices, size = [], 0
    if slices:
        yield key, slices


def _update_bucket(
    slices: list[_Slice], work: dict, state: dict, h: _Hyper, scratch: _Scratch, stochastic: bool
) -> None:
    """One bucket: its elements copied into flat fp32 buffers, updated there, rounded, and copied back."""
    sizes = [end - start for _, start, end in slices]
    w, g, m, v = scratch.take(sum(sizes))
    ws, gs, ms, vs = (list(buf.split(sizes)) for buf in (w, g, m, v))

    def part(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [local(t).view(-1)[start:end] for t, (_, start, end) in zip(tensors, slices)]

    params = [p for p, _, _ in slices]
    weights = part(work[p] for p in params)
    grads = part(p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params)
    exp_avgs = part(state[p]["exp_avg"] for p in params)
    exp_avg_sqs = part(state[p]["exp_avg_sq"] for p in params)
    torch._foreach_copy_(ws, weights)
    torch._foreach_copy_(gs, grads)
    torch._foreach_copy_(ms, exp_avgs)
    torch._foreach_copy_(vs, exp_avg_sqs)
    if h.fused is not None:  # torch's fused Adam(W) kernel: the arithmetic in one pass over the list
        h.fused(
            ws,
            gs,
            ms,
            vs,
            [],
            [h.step_tensor] * len(ws),
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            weight_decay=h.wd,
            eps=h.raw_eps,
            amsgrad=False,
            maximize=False,
        )
        torch._foreach_copy_(exp_avgs, ms)
        torch._foreach_copy_(exp_avg_sqs, vs)
        if stochastic:
            round_stochastically_(w, scratch.noise.bits(w.numel()))
        torch._foreach_copy_(weights, ws)  # stochastic: exact, the low 16 bits are zero; else to nearest
        return
    if h.wd and not h.decoupled:
        g.add_(w, alpha=h.wd)  # Adam's L2 decay enters the moments
    m.lerp_(g, 1 - h.beta1)
    torch._foreach_copy_(exp_avgs, ms)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    torch._foreach_copy_(exp_avg_sqs, vs)
    denom = torch.sqrt(v, out=g).add_(h.eps)  # g is free now
    if h.wd and h.decoupled:
        w.mul_(1 - h.lr * h.wd)
    if h.rounding == "kahan" and "compensation" in state[params[0]]:
        update = m.div_(denom).mul_(-h.step_size)  # m and v are temporaries now
        comps = part(state[p]["compensation"] for p in params)
        kahan_update_buckets_(weights, w, update, comps, work=v)
        return
    w.addcdiv_(m, denom, value=-h.step_size)
    if stochastic:  # noise keyed once per step from torch's generator (noise.py): resumes round alike
        round_stochastically_(w, scratch.noise.bits(w.numel()))
    torch._foreach_copy_(weights, ws)
