"""``diagnose(model, batches) -> Report``: what fp16 and bf16 would do to this model's numbers, measured.

Three stages, all inside a guard that leaves the model as it was found:
1. an fp32 pass with hooks (``collect.measure``): log2 histograms of activations, activation gradients and
   weight gradients per module;
2. the recommendation (``recommend.recommend``): initial loss scale from the largest gradient, then the first
   16-bit format whose range holds the values;
3. the non-finite search (``nonfinite.find_first_nonfinite``) under the target precision, and under a
   fallback candidate before recommending it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._guard import ModelGuard
from mixprec.diagnostics._precision import resolve_target
from mixprec.diagnostics.collect import measure, to_device
from mixprec.diagnostics.nonfinite import NonfiniteEvent, find_first_nonfinite
from mixprec.diagnostics.recommend import choose_scale_exp, recommend
from mixprec.diagnostics.report import LayerStats, Report
from mixprec.precision.base import Precision
from mixprec.precision.formats import BF16, FP16
from mixprec.precision.registry import autocast_modes

_OPTIMIZERS = ("adam", "sgd")


@dataclass
class DiagnoseConfig:
    """Settings of :func:`diagnose` (its keyword arguments, validated here)."""

    precision_target: str = "fp16"
    """Precision the non-finite search runs under first: "fp16", "bf16" (or "fp32" to find where fp32 fails)."""
    max_batches: int = 4
    """Batches taken from ``batches``; each costs two forward/backward passes (fp32 and the target)."""
    lr: float = 1e-3
    """Learning rate for the bf16 lost-update estimate."""
    optimizer: str = "adam"
    """How an update is estimated from a gradient: "adam" (``lr * sign(g)``, Adam's first step) or "sgd"
    (``lr * g``)."""
    headroom: float = 8.0
    """The initial loss scale keeps the largest gradient seen this many times below fp16's max."""
    underflow_tolerance: float = 0.01
    """A format is rejected when more than this fraction of nonzero gradient values would flush to zero."""
    train_mode: bool = True
    """Run the passes in train mode (dropout on, as in training); every module's mode is restored after."""
    nonfinite_batches: int | None = None
    """Batches the non-finite search runs under each precision it checks (None: all ``max_batches``). Each is
    a forward/backward under autocast; fp16 on a CPU without native fp16 runs ~5x slower than fp32, so
    ``mixprec diagnose`` on CPU may want 1. The fp32 histograms always use every batch."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_batches, int) or self.max_batches < 1:
            raise ValueError(f"max_batches must be a positive integer, got {self.max_batches!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(_OPTIMIZERS)}, got {self.optimizer!r}")
        if not self.headroom >= 1:
            raise ValueError(f"headroom must be >= 1 (a factor below fp16's max), got {self.headroom!r}")
        if not 0 <= self.underflow_tolerance < 1:
            raise ValueError(f"underflow_tolerance must be in [0, 1), got {self.underflow_tolerance!r}")
        nb = self.nonfinite_batches
        if nb is not None and (not isinstance(nb, int) or nb < 1):
            raise ValueError(f"nonfinite_batches must be a positive integer or None, got {nb!r}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return True


def diagnose(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    *,
    device: str | torch.device | None = None,
    precision_target: str = "fp16",
    max_batches: int = 4,
    lr: float = 1e-3,
    optimizer: str = "adam",
    headroom: float = 8.0,
    underflow_tolerance: float = 0.01,
    train_mode: bool = True,
    nonfinite_batches: int | None = None,
) -> Report:
    """Measure how fp16 and bf16 would treat ``model``'s activations and gradients, and recommend one.

    ``batches`` yields dicts passed as ``model(**batch)`` (the Trainer's convention); the loss is read from
    the output as the Trainer reads it (:func:`mixprec.models.outputs.extract_loss`). Up to
    ``max_batches`` are used, moved to the model's device. ``device`` defaults to the model's device; the model
    is never moved (pass a device only to assert where it is). Settings are documented on
    :class:`DiagnoseConfig`.

    The model is left as it was: parameters and ``.grad`` untouched (gradients are taken with
    ``torch.autograd.grad``), hooks removed, buffers, train/eval flags, ``requires_grad`` and the RNG states
    restored. Not for the training step path: it synchronises with the device a few times per batch.

    Raises ``ValueError`` for an unknown ``precision_target`` or one this device cannot run (never
    downgrading it), an empty ``batches``, or a model output without a loss.
    """
    cfg = DiagnoseConfig(
        precision_target, max_batches, lr, optimizer, headroom, underflow_tolerance, train_mode, nonfinite_batches
    )
    start = time.perf_counter()
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    model_device = first.device if first is not None else torch.device("cpu")
    dev = torch.device(device) if device is not None else model_device
    if not _same_device(dev, model_device):
        raise ValueError(
            f"diagnose(device={str(dev)!r}) but the model is on {model_device}; move it first "
            f"(model.to({str(dev)!r})) or leave device unset"
        )
    target = resolve_target(cfg.precision_target, dev)  # raises for unknown or unsupported names
    taken = [to_device(b, dev) for b in itertools.islice(iter(batches), cfg.max_batches)]
    if not taken:
        raise ValueError("diagnose needs at least one batch; `batches` was empty")

    modes = autocast_modes(dev)  # each with its strategy, or why this device refuses it
    losses: dict[str, list[float]] = {}
    cache: dict[str, NonfiniteEvent | None] = {}

    with ModelGuard(model, dev):
        if cfg.train_mode:
            model.train()
        m = measure(model, taken, dev, lr=cfg.lr, optimizer=cfg.optimizer)
        losses["fp32"] = m.losses

        def nonfinite(prec: Precision, scale: float) -> NonfiniteEvent | None:
            name = prec.name  # the label of the verdict and its losses in the report
            if name not in cache:
                search = taken[: cfg.nonfinite_batches] if cfg.nonfinite_batches else taken
                try:
                    cache[name], losses[name] = find_first_nonfinite(model, search, prec, scale)
                except RuntimeError as err:  # torch's "mixed dtype" from a layer norm: which parameter, the fix
                    why = prec.model_refusal(model) if "dtype" in str(err) else None
                    if why is None:
                        raise
                    raise ValueError(f"diagnose(): {why}") from err
            return cache[name]

        # The loss scale depends only on the fp32 measurements: chosen once, used by the per-layer scaled
        # fractions, the reasons, and the fp16 non-finite search.
        grads = m.totals["act_grad"].merge(m.totals["weight_grad"])
        k = choose_scale_exp(grads.max_abs, cfg.headroom)
        layers = [LayerStats.from_measurements(lm, k) for lm in m.layers]
        lost = sum(lm.update_lost for lm in m.layers)
        counted = sum(lm.update_counted for lm in m.layers)
        rec = recommend(
            layers=layers,
            totals=m.totals,
            target=target,
            scale_exp=k,
            modes=modes,
            nonfinite=nonfinite,
            headroom=cfg.headroom,
            underflow_tolerance=cfg.underflow_tolerance,
            update_lost=lost / counted if counted else None,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
        )
    acts = m.totals["act"]
    summary = {
        "grad_max": grads.max_abs,
        "grad_underflow_fp16": grads.underflow_fraction(FP16),
        "grad_subnormal_fp16": grads.subnormal_fraction(FP16),
        "grad_underflow_fp16_scaled": grads.underflow_fraction(FP16, k),
        "grad_subnormal_fp16_scaled": grads.subnormal_fraction(FP16, k),
        "grad_underflow_bf16": grads.underflow_fraction(BF16),
        "grad_subnormal_bf16": grads.subnormal_fraction(BF16),
        "act_max": acts.max_abs,
        "act_overflow_fp16": acts.overflow_fraction(FP16),
        "act_overflow_bf16": acts.overflow_fraction(BF16),
        "bf16_update_lost": lost / counted if counted else None,
    }
    return Report(
        layers=layers,
        recommended_precision=rec.precision,
        recommended_init_scale=float(2**k),
        reasons=rec.reasons,
        first_nonfinite=cache.get(target.name),
        precision_target=target.name,
        device=str(dev),
        batches=len(taken),
        seconds=time.perf_counter() - start,
        bf16_supported=any(m.unsupported is None for m in modes if m.format == BF16),
        nonfinite_checks=dict(rec.nonfinite_checks),
        safe_precisions=list(rec.safe),
        summary=summary,
        losses=losses,
        totals=m.totals,
        settings=asdict(cfg),
    )
