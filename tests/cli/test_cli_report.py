"""The end-of-run table of `mixprec train`: every row the issue asks for, in words a newcomer can read."""

from __future__ import annotations

import math
from types import SimpleNamespace

from mixprec.cli._summary_table import format_duration, format_table, last_value, perplexity, printable, summary_rows

SUMMARY = {
    "precision": "fp16",
    "precision_reason": "fp16 was asked for",
    "global_step": 300,
    "skipped_steps": 3,
    "final_loss_scale": 32768.0,
    "train_tokens_per_second": 6543.2,
    "train_samples_per_second": 25.6,
    "peak_memory_bytes": 400 * 2**20,
    "peak_memory_kind": "process peak RSS",
    "train_runtime": 150.0,
}
HISTORY = [
    {"loss": 3.0, "step": 10},
    {"eval_loss": 2.5, "step": 100},
    {"loss": 1.9, "step": 300},
    {"eval_loss": 1.8, "step": 300},
]


def _rows(**overrides):
    kw = dict(
        summary=SUMMARY,
        log_history=HISTORY,
        eval_loss=1.8,
        unigram_baseline=3.1,
        epochs_done=3.0,
        wall_seconds=170.0,
        num_processes=1,
        run_dir="runs/x",
    )
    kw.update(overrides)
    return dict(summary_rows(**kw))


def test_the_rows_hold_what_the_issue_asks_for():
    rows = _rows()
    assert rows["precision"] == "fp16: fp16 was asked for"
    assert rows["steps"] == "300 (3 epochs), 3 skipped"
    assert rows["loss scale"] == "32768 at the end"
    assert rows["train loss"].startswith("1.9000 nats/byte (perplexity 6.69)")  # no mean: the last logged
    mean = _rows(summary={**SUMMARY, "train_loss": 2.25, "train_loss_steps": 300})["train loss"]
    assert mean == "2.2500 nats/byte (perplexity 9.49), the mean over the 300 steps this run took"
    assert rows["validation loss"] == "1.8000 nats/byte (perplexity 6.05)"
    assert rows["unigram baseline"].startswith("3.1000 nats/byte (perplexity 22.20)")
    assert rows["learned"] == "validation loss 1.30 nats/byte below the unigram baseline"
    assert rows["throughput"] == "6,543 tokens/s"
    assert rows["peak memory"] == "400 MiB (process peak RSS)"
    assert rows["time"] == "2m 50s in all, 2m 30s training"


def test_fp32_has_no_loss_scale_and_a_loss_above_the_baseline_says_so():
    rows = _rows(summary={**SUMMARY, "precision": "fp32", "final_loss_scale": None}, eval_loss=3.5)
    assert rows["loss scale"] == "none (fp32 trains without loss scaling)"
    assert "ABOVE" in rows["learned"]


def test_a_diagnosis_gets_its_row():
    diagnosis = SimpleNamespace(recommended_precision="fp16", recommended_init_scale=8192.0)
    assert _rows(diagnosis=diagnosis)["diagnosis"].startswith("recommended fp16 from loss scale 8192")
    assert "diagnosis" not in _rows()


def test_several_processes_are_named_in_the_throughput():
    assert _rows(num_processes=2)["throughput"] == "6,543 tokens/s (all 2 processes together)"


def test_helpers():
    assert last_value(HISTORY, "eval_loss") == (1.8, 300)
    assert last_value(HISTORY, "nope") is None
    assert perplexity(None) is None and perplexity(float("nan")) is None
    assert math.isclose(perplexity(math.log(5.0)), 5.0)
    assert format_duration(42.06) == "42.1s" and format_duration(3725) == "1h 02m"
    table = format_table([("a", "1"), ("long key", "2")], "title")
    assert table.splitlines()[2] == "a         1"


def test_printable_keeps_text_and_defuses_terminal_controls():
    assert printable("def f(x):\n\treturn x  # é") == "def f(x):\n\treturn x  # é"
    assert printable("a\x1b[2Jb\x07c\rd") == "a\ufffd[2Jb\ufffdc\ufffdd"


def test_the_summary_shows_the_per_op_timing_behind_a_policy_auto_raced():
    from mixprec.cli._summary_table import auto_rows, format_table
    from mixprec.precision.op_timing import KindTiming, OpTimingReport, policy_from_timings

    timings = (KindTiming("linear", 8, 30.0, 60.0), KindTiming("attention", 4, 40.0, 10.0))
    report = OpTimingReport("bf16", "cpu", timings, policy_from_timings("bf16", timings), 1.2)
    auto = {
        "chosen": report.policy,
        "step_seconds": {"fp32": 0.12, "bf16": 0.11, report.policy: 0.086},
        "candidates": ["fp32", "bf16", report.policy],
        "op_timing": report.explain(),
    }
    text = format_table(auto_rows(auto), "summary")
    assert "bf16:fp32_ops=attention" in text and "<- chosen" in text
    attention = next(line for line in text.splitlines() if line.strip().startswith("attention"))
    assert "40.00" in attention and "10.00" in attention and attention.rstrip().endswith("fp32")


def test_the_loss_scale_row_follows_the_mode_not_its_spelling():
    # an fp16 policy scales the loss as fp16 does; bf16 (whose guard reports a scale of 1) does not
    policy = _rows(summary={**SUMMARY, "precision": "fp16:fp32_ops=norm", "final_loss_scale": 512.0})
    assert policy["loss scale"] == "512 at the end"
    bf16 = _rows(summary={**SUMMARY, "precision": "bf16", "final_loss_scale": 1.0})
    assert bf16["loss scale"] == "none (bf16 trains without loss scaling)"


def test_a_run_that_compiled_says_what_compiling_cost_and_what_was_kept():
    compiled = {
        "verdict": "not kept",
        "explain": "compile: not kept: 1.3 ms/step gain x 280 steps = 0.36 s < 21.0 s "
        "to compile (eager 30.1 ms a step, compiled 28.8 ms)",
    }
    row = _rows(summary={**SUMMARY, "compile": compiled})["compile"]
    assert row.startswith("not kept: 1.3 ms/step gain x 280 steps = 0.36 s < 21.0 s to compile")
    assert "compile" not in _rows()  # a run that did not compile has no such row
