"""Replay a capsule's step in fp32 and in the run's precision, and name the first module that parts ways.

``replay(capsule)`` (``mixprec replay CAPSULE``) rebuilds the model from the capsule (see
:mod:`mixprec.watch.capsule`), loads the weights the step started from, and runs the step's micro-batches
twice from the same random state: once in fp32, once in the run's precision (its modules in fp32 fallback
included). Module outputs are compared in execution order; the first one that is non-finite in the run's
precision, or whose relative distance to fp32's exceeds ``tol``, is named with its dtype's range and the
largest magnitude it reached in each run. When the forward agrees, the backward of the run's precision (loss
times the step's loss scale) is searched for the first non-finite gradient
(:func:`mixprec.diagnostics.nonfinite.find_first_nonfinite`); one found is checked against the same backward
at loss scale 1 and fp32's, so a step that overflowed only at the loss scale (a routine fp16 scale backoff:
the scaler skips the step and halves the scale) is reported as that, not as the gradient's dtype running out.

Offline tool: it keeps every module output of both forwards (a model's activations, twice).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.hooks import HookRegistry, display_name
from mixprec.diagnostics.nonfinite import find_first_nonfinite
from mixprec.models.outputs import extract_loss
from mixprec.precision.registry import make_precision
from mixprec.tree import strict_json
from mixprec.watch.capsule import Capsule, build_model
from mixprec.watch.fallback import run_in_fp32

DEFAULT_TOL = 0.1
"""Relative L2 distance to fp32's output that counts as diverged: bf16's rounding (2^-9 per op) leaves a few
per mille after a few layers, fp16's less; 10% is a different answer, not noise."""


@dataclass(frozen=True)
class Divergence:
    """The first module whose output (or gradient) in the run's precision leaves fp32's."""

    module: str
    phase: str
    """"forward" or "backward"."""
    kind: str
    """"non-finite", "diverged" (finite, but more than ``tol`` away from fp32) or "scale" (a backward non-finite
    only at the step's loss scale: finite at scale 1 and in fp32)."""
    dtype: str
    """dtype of the output in the run's precision."""
    dtype_max: float
    dtype_smallest_normal: float
    max_abs: float | None
    """Largest finite |value| of the output in the run's precision (None for the backward search)."""
    max_abs_fp32: float | None
    """Largest |value| of the same output in the fp32 run: beyond dtype_max, the format's range ran out."""
    rel_error: float | None
    fp32_finite: bool | None
    """Whether fp32's output was finite: False means the data or the weights, not the precision."""
    loss_scale: float | None = None
    """The loss scale the backward was searched at (None for a forward finding)."""

    def message(self) -> str:
        where = f"{self.module} ({self.phase})"
        if self.kind == "scale":
            return (
                f"first non-finite: {where}, only at the loss scale {self.loss_scale:g}: at scale 1 the "
                "gradients are finite, and in fp32 too; a routine loss-scale backoff (the scaler skipped "
                "the step and lowered the scale), not the format's range running out: nothing to fix "
                "unless the scale keeps falling"
            )
        rng = f"{self.dtype} holds |x| <= {self.dtype_max:.4g} (smallest normal {self.dtype_smallest_normal:.3g})"
        if self.kind == "non-finite":
            seen = f"; in fp32 it reached {self.max_abs_fp32:.4g}" if self.max_abs_fp32 is not None else ""
            cause = (
                " (non-finite in fp32 too: the data or the weights, not the precision)"
                if self.fp32_finite is False
                else ""
            )
            return f"first non-finite: {where}: {rng}{seen}{cause}"
        return (
            f"first divergence: {where}: {self.rel_error:.3g} relative to fp32 (max |x| {self.max_abs:.4g} "
            f"vs {self.max_abs_fp32:.4g} in fp32); {rng}"
        )


@dataclass(frozen=True)
class ReplayResult:
    step: int
    reason: str
    precision: str
    loss_fp32: float
    loss: float
    """The loss in the run's precision (summed over micro-batches, as fp32's)."""
    first: Divergence | None

    def message(self) -> str:
        """What the replay found, in the lines ``mixprec replay`` prints."""
        head = (
            f"step {self.step} ({self.reason}) replayed: loss {self.loss:.6g} in {self.precision}, "
            f"{self.loss_fp32:.6g} in fp32"
        )
        tail = self.first.message() if self.first is not None else "no module parts from fp32 (tolerance met)"
        return f"{head}\n{tail}"

    def to_dict(self) -> dict[str, Any]:
        """The finding as plain data for strict JSON (``mixprec replay --json``): a non-finite loss as None."""
        return strict_json(asdict(self))


def replay(
    capsule: str | Path | Capsule,
    model: nn.Module | None = None,
    device: str | torch.device = "cpu",
    tol: float = DEFAULT_TOL,
) -> ReplayResult:
    """Replay a capsule (a folder or a loaded :class:`Capsule`); ``model`` is needed only when the capsule's
    model is neither the built-in GPT nor a transformers model (its weights are loaded from the capsule)."""
    if not tol > 0:
        raise ValueError(f"replay(tol={tol!r}): the relative tolerance must be > 0, e.g. {DEFAULT_TOL}")
    cap = capsule if isinstance(capsule, Capsule) else Capsule.load(capsule)
    device = torch.device(device)
    base = model if model is not None else build_model(cap.meta["model"])
    base.load_state_dict(cap.weights)
    ref, loss_ref = _trace(base, cap, "fp32", device, [])
    fallbacks = cap.meta.get("fp32_fallback", [])
    run, loss_run = _trace(base, cap, cap.precision, device, fallbacks)
    first = _first_forward(run, ref, tol)
    if first is None:
        first = _first_backward(base, cap, device, fallbacks)
    return ReplayResult(cap.step, cap.meta.get("reason", "?"), cap.precision, loss_ref, loss_run, first)


def _prepared_copy(base: nn.Module, name: str, device: torch.device, fallbacks: list[str]) -> tuple[nn.Module, Any]:
    precision = make_precision(name, device)
    model = precision.convert_module(copy.deepcopy(base).to(device))
    for module in fallbacks:
        run_in_fp32(model.get_submodule(module))
    return model.train(), precision


def _on_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _trace(base, cap: Capsule, name: str, device, fallbacks) -> tuple[list[tuple[str, torch.Tensor]], float]:
    model, precision = _prepared_copy(base, name, device, fallbacks)
    outputs: list[tuple[str, torch.Tensor]] = []
    cap.restore_rng(device)
    total = 0.0
    with HookRegistry() as hooks, torch.no_grad():
        hooks.hook_module_outputs(model, lambda n, t: outputs.append((display_name(n), t.detach().clone())), None)
        for batch in cap.batches:
            with precision.autocast():
                total += float(extract_loss(model(**_on_device(batch, device))).float())
    return outputs, total


def _first_forward(run, ref, tol: float) -> Divergence | None:
    for (name, y), (ref_name, y_ref) in zip(run, ref):
        if name != ref_name or y.shape != y_ref.shape:
            break  # the two forwards took different paths: nothing further lines up
        finite = torch.isfinite(y)
        ref_finite = bool(torch.isfinite(y_ref).all())
        if not bool(finite.all()):
            return _divergence(name, "forward", "non-finite", y, y_ref, None, ref_finite)
        a, b = y.double(), y_ref.double()
        rel = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
        if rel > tol:
            return _divergence(name, "forward", "diverged", y, y_ref, rel, ref_finite)
    return None


def _first_backward(base, cap: Capsule, device, fallbacks) -> Divergence | None:
    scale = float(cap.meta.get("loss_scale", 1.0))
    event = _backward_event(base, cap, cap.precision, device, fallbacks, scale)
    if event is None:
        return None
    # finite at scale 1 and in fp32: the loss scale overflowed, whatever the dtype of the tensor that held the
    # inf (a tied embedding's fp32 gradient is the sum of an fp16 copy's, and reads "float32")
    fp32_finite = _backward_event(base, cap, "fp32", device, [], 1.0) is None
    at_one = event if scale == 1.0 else _backward_event(base, cap, cap.precision, device, fallbacks, 1.0)
    kind = "scale" if at_one is None and fp32_finite else "non-finite"
    info = torch.finfo(getattr(torch, event.dtype))
    return Divergence(
        event.module, "backward", kind, event.dtype, info.max, info.tiny, None, None, None, fp32_finite, scale
    )


def _backward_event(base, cap: Capsule, name: str, device, fallbacks, scale: float):
    model, precision = _prepared_copy(base, name, device, fallbacks)
    cap.restore_rng(device)
    batches = [_on_device(b, device) for b in cap.batches]
    return find_first_nonfinite(model, batches, precision, scale)[0]


def _divergence(name, phase, kind, y, y_ref, rel, ref_finite) -> Divergence:
    info = torch.finfo(y.dtype)
    return Divergence(
        name,
        phase,
        kind,
        str(y.dtype).removeprefix("torch."),
        info.max,
        info.tiny,
        _max_finite(y),
        _max_finite(y_ref),
        rel,
        ref_finite,
    )


def _max_finite(t: torch.Tensor) -> float | None:
    finite = t[torch.isfinite(t)]
    if finite.numel() == 0:
        return None
    value = float(finite.abs().max())
    return value if math.isfinite(value) else None
