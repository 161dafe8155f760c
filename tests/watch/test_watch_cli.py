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
    with pytest.raises(SystemExit) as exc:  # argparse's, in the flag's name, before anything loads
        main(["train", "--watch", "sometimes", "--output-dir", str(tmp_path / "r")])
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "argument --watch: 'sometimes' is not a watch setting" in err[0]


def test_a_scale_backoff_replays_as_one_and_the_capsule_limit_is_said(tmp_path, corpus, capsys):
    # issue 34: replay called a routine fp16 backoff "float32 holds |x| <= 3.4e38"; after 8 capsules writing
    # stopped without a word
    run = tmp_path / "run"
    argv = [
        "train",
        "--data",
        corpus,
        "--model",
        "tiny",
        "--precision",
        "fp16",
        "--lr",
        "1.0",
        "--watch",
        "5",
        "--max-steps",
        "20",
        "--output-dir",
        str(run),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    summary = json.loads((run / "train_summary.json").read_text())["precision_watch"]
    backoffs = [c for c in summary["capsules"] if "loss-scale backoff" in c["reason"]]
    assert len(backoffs) == 1 and summary["capsules_not_written"]["backoff"] >= 1  # one stands for the rest
    assert len(summary["capsules"]) == 1 + summary["max_capsules"] and summary["capsules_not_written"]["limit"] >= 1
    assert "the limit of 8 per run is reached" in err and "per run was reached (WatchConfig.max_capsules)" in err

    assert main(["replay", backoffs[0]["path"], "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    assert first["phase"] == "backward" and first["kind"] == "scale" and first["fp32_finite"] is True
    assert first["loss_scale"] == 65536.0
    assert main(["replay", backoffs[0]["path"]]) == 0
    out = capsys.readouterr().out
    assert "only at the loss scale 65536" in out and "in fp32 too" in out and "float32 holds" not in out
