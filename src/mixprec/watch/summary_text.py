"""The precision watch's lines in a run's summary: what it measured against, the tightest layers, each
warning, skip, fallback and capsule, and the bad steps left without a capsule (and why)."""

from __future__ import annotations

from typing import Any

from mixprec.watch.stagnation import StagnationWarning, stagnation_message


def summary_lines(s: dict[str, Any], numerics_warnings: list[Any]) -> list[str]:
    """``s``: :meth:`PrecisionWatch.summary() <mixprec.watch.watch.PrecisionWatch.summary>`; then the watch's
    numerics warnings (the objects: their messages)."""
    what_if = f" (the run computes in {s['computes_in']}: a what-if)" if s["computes_in"] != s["format"] else ""
    lines = [f"  precision watch: {s['samples']} samples every {s['every']} steps against {s['format']}{what_if}"]
    if s["lowest_headroom"]:
        tight = ", ".join(f"{k} {v:.1f}" for k, v in list(s["lowest_headroom"].items())[:3])
        lines.append(f"    least headroom (binades below the max): {tight}")
    for w in s["warnings"]:
        left = f", ~{w['steps_left']} steps left" if w["steps_left"] is not None else ""
        lines.append(f"    warning at step {w['step']}: {w['layer']} {w['headroom']:.1f} binades{left}")
    if s["skipped_steps_by_module"]:  # most skips first
        traced = ", ".join(f"{m} x{n}" for m, n in list(s["skipped_steps_by_module"].items())[:5])
        lines.append(f"    skipped steps traced to: {traced}")
    for f in s["fp32_fallback"]:
        lines.append(f"    fp32 fallback: {f['module']} from step {f['step'] + 1} ({f['reason']})")
    stagnant = [w for w in numerics_warnings if isinstance(w, StagnationWarning)]
    if stagnant:
        lines.append("    " + stagnation_message(stagnant).removeprefix("precision watch: "))
    for nw in numerics_warnings:
        if not isinstance(nw, StagnationWarning):
            lines.append("    " + nw.message().removeprefix("precision watch: "))
    for c in s["capsules"]:
        lines.append(f"    bad step {c['step']} ({c['reason']}): mixprec replay {c['path']}")
    missing = s["capsules_not_written"]
    if missing.get("backoff"):
        lines.append(
            f"    {missing['backoff']} later loss-scale backoffs have no capsule (the first one above stands for them)"
        )
    if missing.get("limit"):
        lines.append(
            f"    {missing['limit']} later bad steps have no capsule: the limit of {s['max_capsules']} "
            "per run was reached (WatchConfig.max_capsules)"
        )
    return lines
