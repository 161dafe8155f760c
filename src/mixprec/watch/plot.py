"""The headroom plot: each layer's distance to the format's limits over the sampled steps, as a PNG.

Top panel: binades between each layer's largest activation and the format's max (0 = overflow), with the
watch's warnings, skipped steps and fp32 fallbacks marked. Bottom panel: binades between each layer's smallest
significant output gradient (as held, times the loss scale) and the smallest normal (below 0 = values lost to
subnormals). The layers that came closest to a limit are drawn in colour and named; the rest in grey.

Drawn from the watch's samples in memory, or from a run's metrics.jsonl (:func:`series_from_log`), so a resumed
run's plot covers the steps before the resume too. matplotlib is imported lazily, with the Agg backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mixprec.watch.headroom import Sample

FIGURE = "precision_headroom.png"
_NAMED = 6
Series = dict[str, dict[str, list[tuple[int, float]]]]
"""{"act_headroom" | "grad_low_headroom": {layer: [(step, binades), ...]}}"""
_KEYS = ("act_headroom", "grad_low_headroom")


def series_from_samples(samples: Iterable[Sample]) -> Series:
    out: Series = {k: {} for k in _KEYS}
    for s in samples:
        if s.skipped:  # its inf/NaN reached every later layer: the skip is marked, not drawn as a dip to 0
            continue
        for r in s.layers:
            for k in _KEYS:
                v = getattr(r, k)
                if v is not None:
                    out[k].setdefault(r.name, []).append((s.step, float(v)))
    return out


def series_from_log(entries: Iterable[dict[str, Any]]) -> Series:
    """The same series from metrics.jsonl entries (keys ``watch/<layer>/<field>``)."""
    out: Series = {k: {} for k in _KEYS}
    for e in entries:
        if "event" in e or "watch/loss_scale" not in e or e.get("watch/step_skipped"):
            continue
        for key, v in e.items():
            layer, _, field = key[len("watch/") :].rpartition("/")
            if key.startswith("watch/") and field in out and isinstance(v, (int, float)):
                out[field].setdefault(layer, []).append((int(e["step"]), float(v)))
    return out


def plot_headroom(series: Series, path: Path, fmt: str, marks: dict[str, list[tuple[int, str]]] | None = None) -> Path:
    """Write the PNG to ``path`` (a folder gets :data:`FIGURE`); ``marks``: {"warning" | "skip" |
    "fallback": [(step, layer), ...]}. Returns the file."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = path / FIGURE if path.is_dir() else path
    marks = marks or {}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colors = _colors(series)
    _panel(top, series["act_headroom"], f"activations: binades below {fmt} max", colors)
    _panel(
        bottom, series["grad_low_headroom"], f"output gradients (x loss scale): binades above {fmt} min normal", colors
    )
    for ax in (top, bottom):
        ax.axhline(0.0, color="black", lw=1.2)
    for step, layer in marks.get("warning", []):
        if step >= 0:
            _mark(top, step, f"warning: {layer}", "darkorange", at_top=True, color="orange", ls="--", lw=1)
    skips = [step for step, _ in marks.get("skip", [])]
    if skips:
        top.scatter(skips, [0.0] * len(skips), color="red", marker="x", zorder=4, label=f"skipped step ({len(skips)})")
    for step, layer in marks.get("fallback", []):
        _mark(top, step, f"fp32 fallback: {layer}", "green", at_top=False, color="green", lw=1.5)
    top.set_title(f"precision watch: per-layer headroom against {fmt}")
    bottom.set_xlabel("optimizer step")
    top.legend(fontsize=7, loc="upper right")
    bottom.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mark(ax: Any, step: int, text: str, text_color: str, at_top: bool, **line: Any) -> None:
    """A vertical line at ``step`` (``line``: its style) labelled along it, from the panel's top or bottom."""
    ax.axvline(step, **line)
    va, ha = ("top", "right") if at_top else ("bottom", "left")
    ax.annotate(
        text, (step, ax.get_ylim()[1 if at_top else 0]), color=text_color, fontsize=8, rotation=90, va=va, ha=ha
    )


def _ranked(layers: dict[str, list[tuple[int, float]]]) -> list[str]:
    return sorted(layers, key=lambda n: min(v for _, v in layers[n]))


def _colors(series: Series) -> dict[str, Any]:
    """One colour per layer across both panels, the closest to a limit first."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    order: list[str] = []
    for key in _KEYS:
        order += [n for n in _ranked(series[key])[:_NAMED] if n not in order]
    return {name: palette[i % len(palette)] for i, name in enumerate(order)}


def _panel(ax: Any, layers: dict[str, list[tuple[int, float]]], ylabel: str, colors: dict[str, Any]) -> None:
    ranked = _ranked(layers)
    named = set(ranked[:_NAMED])
    for name in reversed(ranked):  # the named layers drawn last, on top
        pts = layers[name]
        xs, ys = [s for s, _ in pts], [v for _, v in pts]
        if name in named:
            ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, ms=3, lw=1.5, label=name, color=colors[name])
        else:
            ax.plot(xs, ys, color="0.75", lw=0.8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
