"""What ``mixprec train`` prints: the run header, the end-of-run summary table and the generated sample.

Pure formatting: every function takes plain values and returns text, so the table is tested without
training anything. The numbers come from the Trainer (its summary dict and ``state.log_history``).
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from typing import Any

from mixprec.precision.decision import AutoDecision
from mixprec.precision.full import FullPrecision
from mixprec.precision.registry import needs_loss_scaling
from mixprec.trainer.phase_clock import breakdown_rows
from mixprec.trainer.summary import mean_over


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)``: the number of equally likely bytes the model is choosing between (inf past 700 nats)."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf


def format_duration(seconds: float) -> str:
    """ "42.1s", "3m 05s", "1h 02m"."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _loss(loss: float | None) -> str:
    if loss is None:
        return "-"
    ppl = perplexity(loss)
    return f"{loss:.4f} nats/byte (perplexity {ppl:.2f})" if ppl is not None else f"{loss}"


def last_value(log_history: Sequence[dict[str, Any]], key: str) -> tuple[float, int] | None:
    """The last ``(value, step)`` of ``key`` in a Trainer's log history, or None if it was never logged."""
    for entry in reversed(log_history):
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), int(entry.get("step", 0))
    return None


def summary_rows(
    *,
    summary: dict[str, Any],
    log_history: Sequence[dict[str, Any]],
    eval_loss: float | None,
    unigram_baseline: float,
    epochs_done: float | None,
    wall_seconds: float,
    num_processes: int,
    run_dir: str,
    diagnosis: Any = None,
) -> list[tuple[str, str]]:
    """The rows of the end-of-run table, from the Trainer's summary dict and log history (and the
    ``mixprec.diagnostics`` Report of ``--diagnose``, if one ran)."""
    rows: list[tuple[str, str]] = []
    comm = f"; {summary['comm']}" if summary.get("comm") else ""  # --comm-dtype, beside the precision
    rows.append(("precision", f"{summary.get('precision')}: {summary.get('precision_reason') or '-'}{comm}"))
    rows += auto_rows(summary.get("auto_precision"))
    if diagnosis is not None:
        advice = f"recommended {diagnosis.recommended_precision} from loss scale {diagnosis.recommended_init_scale:g}"
        rows.append(("diagnosis", f"{advice} (metrics.jsonl has the full report)"))
    steps = summary.get("global_step", 0)
    epochs = f" ({epochs_done:.3g} epochs)" if epochs_done is not None else ""
    rows.append(("steps", f"{steps}{epochs}, {summary.get('skipped_steps', 0)} skipped"))
    scale = summary.get("final_loss_scale")
    if scale is None or not _loss_scaled(summary):
        rows.append(("loss scale", f"none ({summary.get('precision')} trains without loss scaling)"))
    else:
        rows.append(("loss scale", f"{scale:g} at the end"))
    # one train-loss figure, the Trainer's (its stderr line says the same): the mean over the steps this run
    # took. The last logged value (a mean of the last few steps) was a second, different "train loss"
    mean, over = summary.get("train_loss"), summary.get("train_loss_steps")
    if isinstance(mean, (int, float)) and over:
        rows.append(("train loss", f"{_loss(mean)}, {mean_over(summary)}"))
    else:
        train = last_value(log_history, "loss")
        rows.append(("train loss", _loss(train[0]) + f", last logged at step {train[1]}" if train else "-"))
    rows.append(("validation loss", _loss(eval_loss)))
    rows.append(("unigram baseline", f"{_loss(unigram_baseline)}, the best a model ignoring context can do"))
    if eval_loss is not None:
        gap = unigram_baseline - eval_loss
        verdict = "below" if gap > 0 else "ABOVE"
        rows.append(("learned", f"validation loss {abs(gap):.2f} nats/byte {verdict} the unigram baseline"))
    tps = summary.get("train_tokens_per_second")
    per = f" (all {num_processes} processes together)" if num_processes > 1 else ""
    if tps is not None:
        rows.append(("throughput", f"{tps:,.0f} tokens/s{per}"))
    else:
        rows.append(("throughput", f"{summary.get('train_samples_per_second', 0):,.1f} samples/s{per}"))
    peak = summary.get("peak_memory_bytes")
    kind = summary.get("peak_memory_kind")
    rows.append(("peak memory", _bytes(peak) + (f" ({kind})" if kind else "")))
    training = format_duration(summary.get("train_runtime", 0))
    rows.append(("time", f"{format_duration(wall_seconds)} in all, {training} training"))
    if "time" in summary:  # issue 36: where the training time went
        rows.extend(breakdown_rows(summary["time"]))
    if summary.get("compile"):  # issue 36 item 4: what compiling cost, and whether it was kept
        rows.append(("compile", summary["compile"]["explain"].removeprefix("compile: ")))
    rows.append(("run folder", run_dir))
    return rows


def auto_rows(auto: dict[str, Any] | None) -> list[tuple[str, str]]:
    """One row per mode "auto" raced: median and best time of the training step, speed, or why it was
    left out (nothing when the precision was named, or the decision came without a table)."""
    if not auto or not auto.get("step_seconds"):
        return []
    medians, best = auto["step_seconds"], auto.get("best_seconds", {})
    speed = AutoDecision(auto.get("chosen", ""), medians).speedups()  # vs fp32 where measured: the decision's rule
    rows = []
    rank = {n: i for i, n in enumerate(auto.get("candidates", []))}
    ordered = sorted(medians, key=lambda n: rank.get(n, len(rank)))  # safest first, as raced
    for name in [*ordered, *(n for n in auto.get("excluded", {}) if n not in medians)]:
        if name in medians:
            text = f"{medians[name] * 1e3:.1f} ms median, {best.get(name, medians[name]) * 1e3:.1f} ms best"
            text += f" ({speed[name]:.2f}x fp32"
            if name in auto.get("speedup_interval", {}):
                low, high = auto["speedup_interval"][name]
                text += f", 95% interval {low:.2f}-{high:.2f}x"
            text += ")"
        else:
            text = "not timed"
        if name in auto.get("dropped", {}):
            text += f"; dropped after {auto['dropped'][name]} round(s)"
        if name in auto.get("excluded", {}):
            text += f"; excluded: {auto['excluded'][name]}"
        if name == auto.get("chosen"):
            text += "  <- chosen"
        rows.append((f"  auto: {name}", text))
    # the per-op-kind timing behind a policy candidate: each kind's two timings and the choice (issue 23)
    for line in (auto.get("op_timing") or "").splitlines():
        rows.append(("  auto: op kinds" if line.startswith("per-op") else "", line.strip()))
    return rows


def format_table(rows: Sequence[tuple[str, str]], title: str) -> str:
    """Two aligned columns under a title rule."""
    width = max(len(k) for k, _ in rows)
    rule = "-" * max(len(title), 60)
    lines = [title, rule]
    lines += [f"{key.ljust(width)}  {value}" for key, value in rows]
    lines.append(rule)
    return "\n".join(lines)


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control characters other than newline and tab (which could move
    the cursor or ring the bell) become U+FFFD, as do the U+FFFD an invalid byte sequence decoded to."""
    unprintable = ("Cc", "Cs", "Co", "Cn")  # control (\r included), surrogate, private use, unassigned
    return "".join("\ufffd" if unicodedata.category(ch) in unprintable and ch not in "\n\t" else ch for ch in text)


def _loss_scaled(summary: dict[str, Any]) -> bool:
    """The precision's own answer, recorded in the summary; a summary written before it was recorded is read
    at this edge by the registry, from the name it holds."""
    recorded = summary.get("precision_loss_scaling")
    if recorded is not None:
        return bool(recorded)
    return needs_loss_scaling(summary.get("precision") or FullPrecision.name)
