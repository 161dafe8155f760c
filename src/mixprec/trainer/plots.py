"""PNG figures of a run, drawn from its metrics.jsonl: the loss curves, and the loss scale with skipped steps.

matplotlib is imported lazily with the Agg backend, so a headless job never needs a display and a run that
does not plot never pays for the import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixprec.trainer.logging import read_metrics

LOSS_FIGURE = "loss_curves.png"
SCALE_FIGURE = "loss_scale.png"


def _series(entries: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for e in entries:
        if "event" not in e and isinstance(e.get(key), (int, float)):
            steps.append(int(e["step"]))
            values.append(float(e[key]))
    return steps, values


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_run(metrics_path: str | Path, output_dir: str | Path) -> list[Path]:
    """Write loss_curves.png (training and evaluation loss against the step) and loss_scale.png (the scale as
    a step function, skipped steps marked in red; a run without loss scaling shows its constant 1, so every
    run folder has both). Returns the files."""
    entries = read_metrics(metrics_path)
    out = Path(output_dir)
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        steps, values = _series(entries, key)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=label)
    _save(plt, fig, ax, "loss", "loss", out / LOSS_FIGURE)

    changes = [(int(e["step"]), float(e["scale"])) for e in entries if e.get("event") == "loss_scale"]
    skipped = [e for e in entries if e.get("event") == "skipped_step"]
    fig, ax = plt.subplots(figsize=(7, 4))
    title = "fp16 loss scale"
    if not (changes or skipped):  # fp32/bf16: the scaler is a pass-through; say so rather than omit the plot
        steps = [int(e["step"]) for e in entries if "step" in e] or [0]
        ax.step([min(steps), max(steps)], [1.0, 1.0], where="post", label="loss scale (pass-through)")
        title = "loss scale: none (this precision trains without loss scaling)"
    if changes:
        last_step = max([s for s, _ in changes] + [int(e.get("step", 0)) for e in entries])
        xs = [s for s, _ in changes] + [last_step]
        ys = [v for _, v in changes] + [changes[-1][1]]
        ax.step(xs, ys, where="post", label="loss scale")
    if skipped:
        ax.scatter(
            [int(e["step"]) for e in skipped],
            [float(e["loss_scale"]) if e.get("loss_scale") is not None else 1.0 for e in skipped],  # None: no scaler
            color="red",
            marker="x",
            zorder=3,
            label=f"skipped step ({len(skipped)})",
        )
    ax.set_yscale("log", base=2)
    _save(plt, fig, ax, "loss scale", title, out / SCALE_FIGURE)
    return [out / LOSS_FIGURE, out / SCALE_FIGURE]


def _save(plt: Any, fig: Any, ax: Any, ylabel: str, title: str, path: Path) -> None:
    """Label one panel (against the optimizer step, with a legend when it has labelled lines) and write it."""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
