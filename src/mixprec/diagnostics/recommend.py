"""Choosing a precision and an initial loss scale from the measurements, with the reasons in words.

The rule, in order of the candidates (the user's target first, then the other 16-bit format):
a candidate is chosen when its range holds the activations (nothing above its max), its gradients survive
(at most ``underflow_tolerance`` of the nonzero gradient values flushed to zero, for fp16 at the initial
scale), the device runs it, and a real forward/backward under it produced no inf/NaN. fp32 when none passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mixprec.diagnostics.histogram import LogHistogram
from mixprec.diagnostics.nonfinite import NonfiniteEvent
from mixprec.diagnostics.report import LayerStats
from mixprec.precision.base import Precision
from mixprec.precision.formats import FP16, loss_scale_for
from mixprec.precision.registry import AutocastMode, autocast_format

MAX_SCALE_EXP = 24
"""Initial scales are capped at 2^24: past it, fp32 loss * scale itself starts to overflow on large losses,
and the dynamic scaler grows from there anyway."""
DEFAULT_SCALE_EXP = 16
"""torch's GradScaler default (2^16), used when no nonzero gradient was observed."""


def choose_scale_exp(max_grad: float, headroom: float) -> int:
    """The largest k in [0, 24] with ``max_grad * 2^k * headroom <= 65504``: the largest gradient seen stays
    finite in fp16 with ``headroom`` x room for the gradients of later batches to grow."""
    if not (max_grad > 0 and math.isfinite(max_grad)):
        return DEFAULT_SCALE_EXP
    k = math.floor(math.log2(FP16.max / (headroom * max_grad)))
    # floor(log2(.)) in floating point can be off by one next to a power of two: settle it exactly
    while k > -200 and math.ldexp(max_grad * headroom, k) > FP16.max:
        k -= 1
    while math.ldexp(max_grad * headroom, k + 1) <= FP16.max:
        k += 1
    return max(0, min(MAX_SCALE_EXP, k))


@dataclass
class Recommendation:
    precision: str
    scale_exp: int
    reasons: list[str] = field(default_factory=list)
    nonfinite_checks: dict[str, NonfiniteEvent | None] = field(default_factory=dict)
    safe: list[str] = field(default_factory=list)  # every 16-bit format that passed, in the order judged


PURE_BF16_LOSS_LIMIT = 0.001  # above 0.1% of updates rounding away, pure bf16 must compensate


def _worst(layers: list[LayerStats], key: str) -> LayerStats | None:
    scored = [s for s in layers if getattr(s, key)]
    return max(scored, key=lambda s: getattr(s, key)) if scored else None


def _range_problems(
    mode: AutocastMode, grads: LogHistogram, acts: LogHistogram, layers: list[LayerStats], scale_exp: int, tol: float
) -> list[str]:
    fmt, name = mode.format, mode.name  # the format's facts; the mode's name only labels the messages
    out = []
    n_over = acts.overflow.get(fmt.name, 0)  # the histograms count overflow per format
    if n_over:
        key = f"act_overflow_{fmt.name}"
        worst = _worst(layers, key)
        n_layers = sum(1 for s in layers if getattr(s, key))
        out.append(
            f"{n_over} activation values in {n_layers} module(s) exceed {name}'s max {fmt.max:g} and would "
            f"become inf (largest: {worst.name}, up to {worst.act_max:.3g})"
        )
    k = scale_exp if fmt.loss_scaled else 0
    if math.ldexp(grads.max_abs, k) > fmt.max:  # only possible at k = 0: the scale is chosen to avoid it
        out.append(f"gradients up to {grads.max_abs:.3g} exceed {name}'s max {fmt.max:g} even at loss scale 1")
    under = grads.underflow_fraction(fmt, k)
    if under > tol:
        at = f" even at loss scale 2^{k}" if k else ""
        rng = grads.exponent_range()
        span = f" (nonzero gradients span 2^{rng[0]}..2^{rng[1] + 1})" if rng else ""
        out.append(f"{100 * under:.2g}% of nonzero gradient values would flush to zero in {name}{at}{span}")
    return out


def recommend(
    *,
    layers: list[LayerStats],
    totals: dict[str, LogHistogram],
    target: Precision,
    scale_exp: int,
    modes: list[AutocastMode],
    nonfinite: Callable[[Precision, float], NonfiniteEvent | None],
    headroom: float,
    underflow_tolerance: float,
    update_lost: float | None,
    lr: float,
    optimizer: str,
) -> Recommendation:
    """Pick the precision, and explain it and the initial loss scale 2^``scale_exp`` (from
    :func:`choose_scale_exp`; the per-layer ``*_scaled`` fields already used it).

    ``modes`` are the 16-bit candidates (:func:`~mixprec.precision.registry.autocast_modes`), each with its format
    and its strategy or why the device refuses it; ``target`` is tried first when it is one of them (fp32 is
    not: it is searched for inf/NaN only). ``nonfinite(precision, scale)`` runs the non-finite search under that
    strategy (cached by the caller); ``update_lost`` is the model-wide fraction of weight updates pure-bf16
    weights would lose. Names appear only as the labels of the verdicts."""
    grads = totals["act_grad"].merge(totals["weight_grad"])
    acts = totals["act"]
    k = scale_exp
    target_fmt = autocast_format(target)  # None for an fp32 target
    reasons: list[str] = []
    checks: dict[str, NonfiniteEvent | None] = {}

    if grads.max_abs > 0:
        g = f"the largest gradient seen ({grads.max_abs:.3g})"
        if k == MAX_SCALE_EXP:
            why = f"the cap; {g} would allow more"
        elif k == 0 and grads.max_abs * headroom > FP16.max:
            why = f"the floor; {g} leaves less than {headroom:g}x headroom below fp16's max 65504 even unscaled"
        else:
            why = f"{g} times 2^{k} stays below fp16's max 65504 with {headroom:g}x headroom"
        reasons.append(f"initial loss scale 2^{k} ({why})")
        at1, atk = grads.underflow_fraction(FP16), grads.underflow_fraction(FP16, k)
        if at1 > 0:
            reasons.append(
                f"at scale 1, fp16 would flush {100 * at1:.3g}% of nonzero gradient values to zero; "
                f"at 2^{k}, {100 * atk:.3g}%"
            )
    else:
        reasons.append(f"no nonzero gradient was observed; initial loss scale left at the default 2^{k}")

    if acts.nonfinite or grads.nonfinite:
        reasons.append(
            f"the model already produces inf/NaN in fp32 ({acts.nonfinite} activation and {grads.nonfinite} "
            "gradient values): fix that first; no lower precision can be judged"
        )
        checks[target.name] = nonfinite(target, loss_scale_for(target_fmt, k) if target_fmt else 1.0)
        return Recommendation("fp32", k, reasons, checks)

    # the target's own mode first (judged by its format: the device runs it, or it was refused before this),
    # then the others in their order
    order = sorted(modes, key=lambda m: m.format != target_fmt)
    if target_fmt is None:  # fp32 target: still report where fp32 itself goes non-finite
        checks[target.name] = nonfinite(target, 1.0)
    chosen: AutocastMode | None = None
    safe: list[str] = []
    for mode in order:
        name, is_target = mode.name, mode.format == target_fmt
        scale = loss_scale_for(mode.format, k)
        problems = []
        if mode.unsupported:
            problems.append(mode.unsupported)
        else:
            problems += _range_problems(mode, grads, acts, layers, k, underflow_tolerance)
        # the non-finite pass runs as before (the target, and the first fallback that passes): a format judged
        # after a safe one is judged by its ranges alone (no extra pass, no clash with an ambient autocast)
        if (is_target or (not problems and chosen is None)) and mode.precision is not None:
            checks[name] = event = nonfinite(target if is_target else mode.precision, scale)
            if event is not None:
                problems.append(
                    f"under {name} autocast the first inf/NaN appears in {event.module} ({event.phase}, "
                    f"{event.what}, {event.dtype})"
                )
        if problems:
            reasons += [f"not {name}: {p}" for p in problems]
        else:  # every format is judged (not only up to the first that passes): speed picks among the safe
            safe.append(mode.format.name)  # the report lists the formats that hold the values
            chosen = chosen or mode
    if chosen is None:
        reasons.append("fp32: neither 16-bit format holds this model's values on this device")
    elif chosen.format.loss_scaled:
        reasons.append(f"fp16 holds the activations and, scaled by 2^{k}, the gradients")
    else:
        reasons.append("bf16 holds the activations and gradients without loss scaling (fp32's exponent range)")

    if update_lost and update_lost >= PURE_BF16_LOSS_LIMIT:
        worst = _worst(layers, "bf16_update_lost")
        reasons.append(
            f"pure bf16 needs compensation here: with bf16 weights rounded to nearest, {optimizer} at lr={lr:g} "
            f"would lose {100 * update_lost:.3g}% of weight updates (worst: {worst.name}, "
            f"{100 * worst.bf16_update_lost:.3g}%); keep fp32 master weights (the mixed modes do) or use "
            "precision='bf16-pure' (stochastic rounding) or 'bf16-pure-kahan' (Kahan summation), which keep them"
        )
    elif update_lost is not None:
        reasons.append(
            f"pure bf16 would lose {100 * update_lost:.3g}% of weight updates at lr={lr:g} (under "
            f"{100 * PURE_BF16_LOSS_LIMIT:g}%): precision='bf16-pure' needs no compensation for this model, "
            "though its stochastic rounding costs little"
        )
    return Recommendation(chosen.name if chosen else "fp32", k, reasons, checks, safe)
