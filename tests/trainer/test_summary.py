"""The end-of-run summary's lines agree with each other (trainer/summary.py)."""

from __future__ import annotations

from mixprec.trainer.summary import format_summary


def summary(global_step: int, steps_this_run: int) -> dict:
    return {
        "global_step": global_step,
        "train_loss_steps": steps_this_run,
        "train_runtime": 12.0,
        "precision": "fp16",
        "train_loss": 5.36,
        "skipped_steps": 0,
        "train_samples_per_second": 7.4,
        "peak_memory_bytes": 2**20,
        "peak_memory_kind": "process peak RSS",
    }


def test_a_resumed_run_says_the_steps_it_took_as_its_rates_and_loss_count_them():
    lines = format_summary(summary(global_step=21, steps_this_run=11)).splitlines()
    assert lines[0].startswith("trained 11 steps (21 in all) in 12.0s (fp16)")
    assert "the mean over the 11 steps this run took" in lines[1]


def test_a_whole_run_says_its_steps_once():
    assert format_summary(summary(global_step=21, steps_this_run=21)).startswith("trained 21 steps in 12.0s (fp16)")
