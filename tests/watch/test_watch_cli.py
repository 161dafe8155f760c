"""`mixprec train --watch N`: the one flag turns the watch on, and the run folder holds what it saw."""

from __future__ import annotations

import json

import pytest

from mixprec.cli.main import main

FAST = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--epoch-tokens", "256", "--epochs", "1"]


pytestmark = pytest.mark.usefixtures("quick_train_cli")  # conftest.py: tmp_path as cwd, a short sample, one thread


def test_watch_flag_writes_samples_summary_and_plot(tmp_path, capsys):
    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), *FAST, "--precision", "fp16", "--watch", "1", "--output-dir", str(run)]
    assert main(argv) == 0
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sampled = [e["step"] for e in entries if "watch/loss_scale" in e]
    assert sampled == [1, 2]
    last = next(e for e in reversed(entries) if "watch/loss_scale" in e)
    assert "watch/transformer.h.0/act_headroom" in last and "watch/lm_head/grad_low_headroom" in last
    summary = json.loads((run / "train_summary.json").read_text())["precision_watch"]
    assert summary["every"] == 1 and summary["format"] == "fp16" and summary["samples"] == 2
    assert (run / "precision_headroom.png").read_bytes()[:4] == b"\x89PNG"
    assert "precision watch: 2 samples every 1 steps against fp16" in capsys.readouterr().err


def test_a_bad_watch_value_is_a_one_line_error(tmp_path, capsys):
    assert main(["train", "--watch", "sometimes", "--output-dir", str(tmp_path / "r")]) == 2
    assert "precision_watch" in capsys.readouterr().err
