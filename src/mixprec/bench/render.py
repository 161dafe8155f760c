"""A benchmark's three outputs: the terminal table, the PNG chart and the JSON document."""

from __future__ import annotations

import json
from pathlib import Path

from mixprec.bench.result import BenchResult
from mixprec.precision.decision import AutoDecision
from mixprec.tree import strict_json


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def _num(x: float | None, fmt: str) -> str:
    """``x`` formatted, "-" for None; a value that rounds to zero prints without a sign's minus (issue 29:
    fp32's own loss-fp32 printed "-0.0000")."""
    if x is None:
        return "-"
    text = format(x, fmt)
    if text.startswith("-") and not text.strip("-+0.,%"):  # only zeros after the sign
        return ("+" if "+" in fmt else "") + text[1:]
    return text


def format_table(result: BenchResult) -> str:
    """The human-readable report: one row per precision, then what each column measured."""
    data = result.to_dict()
    header = [
        "precision",
        "runs as",
        "step (median)",
        "spread (IQR)",
        "tokens/s",
        "vs fp32",
        "peak mem",
        "B/param",
        "loss",
        "loss-fp32",
        "skipped",
        "MFU",
    ]
    lines: list[list[str]] = []
    for r in data["results"]:
        if r["skipped"]:
            lines.append([r["precision"], "not run", r["skipped"][:60], *[""] * 9])
            continue
        runs_as = r["resolved"] + (f" (= {r['shares_measurement_with']} row)" if r["shares_measurement_with"] else "")
        lines.append(
            [
                r["precision"],
                runs_as,
                _time(r["step_time_s"]),
                "±" + _time(r["step_time_spread_s"] / 2) if r["step_time_spread_s"] is not None else "-",
                _num(r["tokens_per_s"], ",.0f"),
                _num(r["speedup_vs_fp32"], ".2f") + ("x" if r["speedup_vs_fp32"] is not None else ""),
                _mib(r["peak_mem_bytes"]),
                _num(r.get("bytes_per_param"), ".1f"),
                _num(r["loss"], ".4f"),
                _num(r["loss_vs_fp32"], "+.4f"),
                str(r["skipped_steps"]),
                "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f}%",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [
        f"mixprec bench on {data['device']} ({data['device_name']}, {data['threads']} "
        f"thread{'' if data['threads'] == 1 else 's'}, torch "
        f"{data['torch_version']})",
        f"workload: {data['workload']}",
        f"{data['config']['rounds']} interleaved rounds x {data['config']['steps']} timed steps per precision after "
        f"{data['config']['warmup']} warm-up step(s)",
        "",
        fmt.format(*header),
        fmt.format(*("-" * w for w in widths)),
        *(fmt.format(*row) for row in lines),
        "",
        "step: median seconds per optimizer step; spread: ± half the interquartile range; B/param: parameters + "
        "gradients + optimizer state, bytes per parameter; loss: held-out loss after the run (nats)",
    ]
    peaks = {r["peak_flops_source"] for r in data["results"] if r["peak_flops_source"]}
    if peaks:
        out.append("MFU = flops/token x tokens/s / peak; " + data["flops_per_token_source"])
        out.extend(f"  peak {p}" for p in sorted(peaks))
    mems = {r["peak_mem_source"] for r in data["results"] if not r["skipped"]}
    out.extend(f"peak mem: {m}" for m in sorted(mems))
    verdict = data["auto"]
    if verdict:
        state = "within" if verdict["within_tolerance"] else "NOT within"
        out.append(
            f"auto chose {verdict['chose']}: {verdict['ratio_to_fastest']:.3f}x the fastest ({verdict['fastest']}), "
            f"{state} {verdict['tolerance']:.0%}"
        )
    race = data.get("auto_race")
    if race:
        out.append("auto's race on the first batch's training step (forward+backward), before the bench:")
        out.extend(f"  {line}" for line in AutoDecision.from_dict(race).table().splitlines())
    out.extend(f"note: {n}" for n in data["notes"])
    out.append(f"took {data['wall_seconds']:.1f} s")
    return "\n".join(out)


def to_json(result: BenchResult) -> str:
    """The ``--json`` document as text (one object; NaN is written as null so every parser reads it)."""
    return json.dumps(strict_json(result.to_dict()), indent=2, allow_nan=False)


def write_chart(result: BenchResult, path: str | Path) -> Path:
    """A PNG with two panels: median step time (error bars: min..max) and peak memory per precision.

    matplotlib is imported here, with the Agg backend, so nothing else needs it and no display is opened.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.to_dict()["results"] if r["step_time_s"] is not None]
    if not rows:
        raise ValueError("no precision was timed; nothing to chart")
    labels = [
        r["precision"] if r["precision"] == r["resolved"] else f"{r['precision']}\n({r['resolved']})" for r in rows
    ]
    times = [r["step_time_s"] * 1e3 for r in rows]
    err = [
        [(r["step_time_s"] - r["step_time_min_s"]) * 1e3 for r in rows],
        [(r["step_time_max_s"] - r["step_time_s"]) * 1e3 for r in rows],
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(labels, times, yerr=err, capsize=4, color="tab:blue")
    axes[0].set_ylabel("median step time (ms), bars: min..max")
    axes[0].set_title("step time (lower is faster)")
    for i, r in enumerate(rows):
        if r["speedup_vs_fp32"] is not None:
            # above the error bar, so the two never overlap
            axes[0].annotate(
                f"{r['speedup_vs_fp32']:.2f}x vs fp32",
                (i, r["step_time_max_s"] * 1e3),
                ha="center",
                va="bottom",
                xytext=(0, 2),
                textcoords="offset points",
            )
    mem = [(r["peak_mem_bytes"] or 0) / 2**20 for r in rows]
    axes[1].bar(labels, mem, color="tab:orange")
    axes[1].set_ylabel("peak memory (MiB)")
    axes[1].set_title("peak memory" + ("" if any(mem) else " (not measured)"))
    fig.suptitle(f"mixprec bench: {result.device} ({result.device_name})", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
