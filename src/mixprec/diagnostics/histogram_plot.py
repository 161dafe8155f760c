"""The Micikevicius et al. (2018) figure for any model: gradient and activation magnitudes against the
fp16 and bf16 ranges.

matplotlib is imported inside the function, with the Agg backend, so ``import mixprec.diagnostics`` stays
light and plotting works on machines without a display. The figure is drawn from the histograms and the
title alone: :meth:`~mixprec.diagnostics.report.Report.plot` says what they are, so this module does not
know the Report (which calls down here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from mixprec.diagnostics.histogram import E_MIN, LogHistogram
from mixprec.precision.formats import BF16, FP16

_PANELS = (
    ("act_grad", "activation gradients"),
    ("weight_grad", "weight gradients"),
    ("act", "activations (module outputs)"),
)


def _xrange(h: LogHistogram, shift: int) -> tuple[int, int]:
    # always show fp16's whole range, plus whatever the data populates (and its scaled copy)
    lo, hi = FP16.min_subnormal_exp - 4, math.ceil(math.log2(FP16.max)) + 4
    rng = h.exponent_range()
    return (min(lo, rng[0] - 2), max(hi, rng[1] + shift + 3)) if rng else (lo, hi)


def plot_magnitudes(
    totals: Mapping[str, LogHistogram], path: str, *, init_scale: float, title: str, dpi: int = 110
) -> str:
    """Write a PNG with one panel per kind of value in ``totals`` ("act_grad", "weight_grad", "act"): the
    model-wide log2-magnitude histogram (fraction of nonzero values per binary exponent), for gradients also
    the same histogram at ``init_scale`` (the recommended initial loss scale), with fp16's normal and
    subnormal ranges shaded and bf16's range as a band along the top; ``title`` above them. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; leaves a backend the user already chose
    import matplotlib.pyplot as plt

    k = int(math.log2(init_scale))
    fig, axes = plt.subplots(len(_PANELS), 1, figsize=(10, 2.9 * len(_PANELS)), layout="constrained")
    for ax, (kind, panel) in zip(axes, _PANELS):
        h = totals.get(kind) or LogHistogram()
        shift = k if kind != "act" else 0
        lo, hi = _xrange(h, shift)
        _shade(ax, lo, hi)
        n = h.nonzero
        xs = list(range(lo, hi + 1))
        ys = [h.counts[x - E_MIN] / n if n and 0 <= x - E_MIN < len(h.counts) else 0.0 for x in xs]
        ax.bar(xs, ys, width=1.0, align="edge", color="tab:blue", alpha=0.85, label="fp32 values (scale 1)")
        if shift:
            ax.step(
                [x + shift for x in xs],
                ys,
                where="post",
                color="tab:red",
                lw=1.4,
                label=f"x loss scale 2^{k}",
            )
        ax.set_xlim(lo, hi + 1)
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_ylim(0, 1.05)
        zeros = f", {h.zeros} exact zeros" if h.zeros else ""
        ax.set_title(f"{panel}: {n} nonzero values{zeros}", fontsize=10)
        ax.set_ylabel("fraction")
    axes[-1].set_xlabel("log2 |value|")
    # one legend for all panels, below them: inside a panel it would cover the data of some model
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _shade(ax, lo: int, hi: int) -> None:
    fp16_top = math.log2(FP16.max)
    ax.axvspan(FP16.min_subnormal_exp, FP16.min_normal_exp, color="orange", alpha=0.15, label="fp16 subnormal")
    ax.axvspan(FP16.min_normal_exp, fp16_top, color="green", alpha=0.12, label="fp16 normal")
    # bf16 spans 2^-133..2^128, wider than most axes: a band along the top keeps fp16's shading readable
    ax.axvspan(
        max(lo, BF16.min_subnormal_exp),
        min(hi + 1, math.log2(BF16.max)),
        ymin=0.96,
        ymax=1.0,
        color="purple",
        alpha=0.5,
        label="bf16 range",
    )
    ax.axvline(FP16.min_subnormal_exp, color="orange", lw=0.8, ls="--")
    ax.axvline(fp16_top, color="red", lw=0.8, ls="--")
