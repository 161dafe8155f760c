"""The diagnosis result: per-layer statistics, the recommendation, a JSON form and a text table.

Conventions for every fraction below: gradient underflow/subnormal fractions are of the *nonzero finite*
gradient values (exact zeros are representable in every format, and dead units or unused embedding rows would
otherwise dilute the number); activation overflow fractions are of *all* output elements. A fraction is
``None`` when there was nothing to count (a module without parameters has no weight gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mixprec.diagnostics.collect import LayerMeasurements
from mixprec.diagnostics.histogram import LogHistogram
from mixprec.diagnostics.histogram_plot import plot_magnitudes
from mixprec.diagnostics.hooks import display_name
from mixprec.diagnostics.nonfinite import NonfiniteEvent
from mixprec.precision.formats import BF16, FP16


def _frac(h: LogHistogram, fn: str, *args: Any) -> float | None:
    return getattr(h, fn)(*args) if h.nonzero else None


@dataclass
class LayerStats:
    """One module's numbers. ``grad_*`` counts every gradient the module's backward produces: its own
    parameters' gradients and the gradients of its outputs; ``weight_grad_*`` and ``act_grad_*`` split them.
    ``*_scaled`` fields are at the recommended initial loss scale."""

    name: str
    type: str
    params: int
    grad_max: float
    grad_zero_fraction: float | None
    grad_underflow_fp16: float | None
    grad_subnormal_fp16: float | None
    grad_underflow_fp16_scaled: float | None
    grad_subnormal_fp16_scaled: float | None
    grad_underflow_bf16: float | None
    grad_subnormal_bf16: float | None
    weight_grad_underflow_fp16: float | None
    weight_grad_underflow_fp16_scaled: float | None
    act_grad_underflow_fp16: float | None
    act_grad_underflow_fp16_scaled: float | None
    act_max: float
    act_overflow_fp16: float | None
    act_overflow_bf16: float | None
    act_nonfinite: float | None
    """Fraction of outputs already inf/NaN in the fp32 pass."""
    bf16_update_lost: float | None
    """Fraction of nonzero weight updates a pure-bf16 weight would round away (see DiagnoseConfig.optimizer)."""
    histograms: dict[str, LogHistogram] = field(default_factory=dict, repr=False)
    """"act", "act_grad", "weight_grad" histograms (only in to_dict(histograms=True))."""

    @classmethod
    def from_measurements(cls, m: LayerMeasurements, scale_exp: int) -> LayerStats:
        act, ag, wg = m.hists["act"], m.hists["act_grad"], m.hists["weight_grad"]
        g = ag.merge(wg)
        total_grads = g.nonzero + g.zeros
        return cls(
            name=display_name(m.name),
            type=m.type,
            params=m.params,
            grad_max=g.max_abs,
            grad_zero_fraction=g.zeros / total_grads if total_grads else None,
            grad_underflow_fp16=_frac(g, "underflow_fraction", FP16),
            grad_subnormal_fp16=_frac(g, "subnormal_fraction", FP16),
            grad_underflow_fp16_scaled=_frac(g, "underflow_fraction", FP16, scale_exp),
            grad_subnormal_fp16_scaled=_frac(g, "subnormal_fraction", FP16, scale_exp),
            grad_underflow_bf16=_frac(g, "underflow_fraction", BF16),
            grad_subnormal_bf16=_frac(g, "subnormal_fraction", BF16),
            weight_grad_underflow_fp16=_frac(wg, "underflow_fraction", FP16),
            weight_grad_underflow_fp16_scaled=_frac(wg, "underflow_fraction", FP16, scale_exp),
            act_grad_underflow_fp16=_frac(ag, "underflow_fraction", FP16),
            act_grad_underflow_fp16_scaled=_frac(ag, "underflow_fraction", FP16, scale_exp),
            act_max=act.max_abs,
            act_overflow_fp16=act.overflow_fraction(FP16) if act.total else None,
            act_overflow_bf16=act.overflow_fraction(BF16) if act.total else None,
            act_nonfinite=act.nonfinite / act.total if act.total else None,
            bf16_update_lost=m.update_lost / m.update_counted if m.update_counted else None,
            histograms=dict(m.hists),
        )

    def severity(self) -> tuple[float, ...]:
        """Sort key, larger is worse: overflow first (it breaks a run), then underflow that scaling does not
        rescue, then underflow at scale 1, then precision lost to subnormals, then lost bf16 updates."""
        z = lambda v: v or 0.0
        return (
            z(self.act_nonfinite) + z(self.act_overflow_bf16),
            z(self.act_overflow_fp16),
            z(self.grad_underflow_fp16_scaled),
            z(self.grad_underflow_fp16),
            z(self.grad_subnormal_fp16_scaled),
            z(self.bf16_update_lost),
        )

    def to_dict(self, histograms: bool = False) -> dict[str, Any]:
        d = {k: _json_float(v) for k, v in self.__dict__.items() if k != "histograms"}
        if histograms:
            d["histograms"] = {k: h.to_dict() for k, h in self.histograms.items()}
        return d


def _json_float(v: Any) -> Any:
    # json.dumps writes inf/nan as bare Infinity/NaN, which is not JSON; max_abs is finite by construction,
    # this is a guard for the rest
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


@dataclass
class Report:
    """What :func:`mixprec.diagnostics.diagnose` found. ``layers`` are in module order (``model.named_modules()``)."""

    layers: list[LayerStats]
    recommended_precision: str
    """"fp16", "bf16" or "fp32"."""
    recommended_init_scale: float
    """A power of two: the loss scale to start fp16 training at (used only when the precision is fp16)."""
    reasons: list[str]
    first_nonfinite: NonfiniteEvent | None
    """Under ``precision_target``, with forward in autocast and backward at the fp16 scale (1 for bf16)."""
    precision_target: str
    device: str
    batches: int
    seconds: float
    bf16_supported: bool
    nonfinite_checks: dict[str, NonfiniteEvent | None] = field(default_factory=dict)
    """Every precision the non-finite search ran under (the target, and a fallback candidate if one ran)."""
    summary: dict[str, float | None] = field(default_factory=dict)
    """Model-wide fractions, same names as the per-layer fields."""
    losses: dict[str, list[float]] = field(default_factory=dict)
    """Per precision: the loss of each batch run under it ("fp32" is the measurement pass)."""
    totals: dict[str, LogHistogram] = field(default_factory=dict, repr=False)
    """Model-wide histograms per kind ("act", "act_grad", "weight_grad")."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The DiagnoseConfig values used."""
    safe_precisions: list[str] = field(default_factory=list)
    """Every 16-bit format whose range holds this model's values on this device (safety alone, not speed)."""
    speed: dict[str, Any] | None = None
    """What "auto"'s race measured on the same batch (``AutoDecision.to_dict``), when the caller raced it:
    the recommendation is then the fastest of the safe modes, as ``mixprec train`` under auto would pick."""

    def to_dict(self, histograms: bool = False) -> dict[str, Any]:
        """JSON-ready (``json.dumps`` works on it). ``histograms=True`` adds each layer's histograms; the
        model-wide ones are always included under ``"histograms"``."""
        return {
            "recommended_precision": self.recommended_precision,
            "recommended_init_scale": self.recommended_init_scale,
            "reasons": list(self.reasons),
            "first_nonfinite": self.first_nonfinite.to_dict() if self.first_nonfinite else None,
            "precision_target": self.precision_target,
            "device": self.device,
            "batches": self.batches,
            "seconds": self.seconds,
            "bf16_supported": self.bf16_supported,
            "nonfinite_checks": {k: v.to_dict() if v else None for k, v in self.nonfinite_checks.items()},
            "summary": {k: _json_float(v) for k, v in self.summary.items()},
            "losses": {k: [_json_float(x) for x in v] for k, v in self.losses.items()},
            "settings": dict(self.settings),
            "safe_precisions": list(self.safe_precisions),
            "speed": self.speed,
            "histograms": {k: h.to_dict() for k, h in self.totals.items()},
            "layers": [layer.to_dict(histograms) for layer in self.layers],
        }

    def worst_layers(self, top: int | None = None) -> list[LayerStats]:
        """The layers worst first (by ``LayerStats.severity``: overflow, then underflow scaling cannot rescue, ...)."""
        ranked = sorted(self.layers, key=lambda s: s.severity(), reverse=True)
        return ranked[:top] if top is not None else ranked

    def table(self, top: int = 15) -> str:
        """A readable text table of the ``top`` worst layers, with the recommendation above it."""
        scale = self.recommended_init_scale
        basis = "the fastest of the safe modes" if self.speed else "the first safe mode (speed not measured)"
        lines = [
            f"recommended precision: {self.recommended_precision} ({basis})    initial loss scale (fp16): "
            f"2^{int(math.log2(scale))} = {scale:g}",
            f"  safety: {', '.join(self.safe_precisions) or 'no 16-bit format'} "
            f"hold{'s' if len(self.safe_precisions) == 1 else ''} this model's values; fp32 always does",
        ]
        if self.speed:
            lines.append(f"  speed: {self.speed.get('summary', '')}")
        lines += [f"  - {r}" for r in self.reasons]
        fn = self.first_nonfinite
        where = f"{fn.module} ({fn.phase}, {fn.what}, {fn.dtype}, batch {fn.batch})" if fn else "none found"
        lines += [f"first non-finite under {self.precision_target}: {where}", ""]
        cols = [
            ("layer", 28, lambda s: s.name),
            ("type", 14, lambda s: s.type),
            ("act max", 9, lambda s: _num(s.act_max)),
            (">fp16max", 8, lambda s: _pct(s.act_overflow_fp16)),
            ("grad max", 9, lambda s: _num(s.grad_max)),
            ("fp16 0@1", 8, lambda s: _pct(s.grad_underflow_fp16)),
            ("fp16 0@S", 8, lambda s: _pct(s.grad_underflow_fp16_scaled)),
            ("subn@S", 7, lambda s: _pct(s.grad_subnormal_fp16_scaled)),
            ("bf16 0", 7, lambda s: _pct(s.grad_underflow_bf16)),
            ("bf16 upd lost", 13, lambda s: _pct(s.bf16_update_lost)),
        ]
        lines.append("  ".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (h, w, _) in enumerate(cols)))
        for s in self.worst_layers(top):
            cells = []
            for i, (_, w, get) in enumerate(cols):
                v = str(get(s))
                if len(v) > w:
                    v = "…" + v[-(w - 1) :]  # keep the end of a long qualified name: the leaf is what differs
                cells.append(f"{v:<{w}}" if i < 2 else f"{v:>{w}}")
            lines.append("  ".join(cells).rstrip())
        hidden = len(self.layers) - min(top, len(self.layers))
        lines.append("")
        lines.append(
            f"{len(self.layers)} modules, worst first{f' ({hidden} more not shown)' if hidden else ''}. "
            "fp16 0@1 / 0@S: nonzero gradients fp16 flushes to zero at scale 1 / at the initial scale S; "
            "subn@S: held only as fp16 subnormals at S; bf16 upd lost: updates pure-bf16 weights would lose "
            f"({self.settings.get('optimizer', '?')}, lr={self.settings.get('lr', '?')})."
        )
        return "\n".join(lines)

    def plot(self, path: str, **kwargs: Any) -> str:
        """Write a PNG of the model-wide histograms with the fp16 and bf16 ranges shaded; returns the path."""
        batches = f"{self.batches} batch{'es' if self.batches != 1 else ''}"
        k = int(math.log2(self.recommended_init_scale))
        title = (
            f"recommended: {self.recommended_precision}, initial loss scale 2^{k} "
            f"(target {self.precision_target}, {batches} on {self.device})"
        )
        return plot_magnitudes(self.totals, path, init_scale=self.recommended_init_scale, title=title, **kwargs)


def _pct(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if v == 1:
        return "100%"
    return f"{100 * v:.1f}%" if v >= 0.001 else f"{100 * v:.2g}%"


def _num(v: float) -> str:
    return "0" if v == 0 else f"{v:.2e}"
