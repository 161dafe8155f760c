"""The run folder's plots: the loss curves, and the loss scale for every precision (a run without loss
scaling says so on its plot instead of leaving the user to wonder where it went)."""

from __future__ import annotations

import json

from mixprec.trainer.plots import LOSS_FIGURE, SCALE_FIGURE, plot_run

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_a_run_without_loss_scaling_still_gets_both_plots(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 11)] + [{"step": 10, "eval_loss": 2.5}])
    written = plot_run(metrics, tmp_path)
    assert [p.name for p in written] == [LOSS_FIGURE, SCALE_FIGURE]
    assert all(p.read_bytes().startswith(PNG) for p in written)


def test_a_skipped_step_without_a_scaler_is_plotted_not_a_crash(tmp_path):
    # fp32/bf16 record a skipped (non-finite) step with loss_scale None: train() ended in a TypeError here
    metrics = tmp_path / "metrics.jsonl"
    entries = [{"step": s, "loss": 1.0} for s in range(1, 5)]
    _write(metrics, [*entries, {"event": "skipped_step", "step": 3, "loss_scale": None}])
    written = plot_run(metrics, tmp_path)
    assert [p.name for p in written] == [LOSS_FIGURE, SCALE_FIGURE]


def test_an_fp16_run_plots_scale_changes_and_skips(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    entries = [{"event": "loss_scale", "step": 0, "scale": 65536.0}, {"step": 1, "loss": 3.0}]
    entries += [{"event": "skipped_step", "step": 2, "loss_scale": 65536.0}]
    entries += [{"event": "loss_scale", "step": 2, "scale": 32768.0}, {"step": 3, "loss": 2.9}]
    _write(metrics, entries)
    written = plot_run(metrics, tmp_path)
    assert (tmp_path / SCALE_FIGURE) in written and (tmp_path / SCALE_FIGURE).stat().st_size > 1000
