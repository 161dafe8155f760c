"""`mixprec train --precision auto`: the race on the real step, shown in the summary, recorded in the run
folder and the checkpoint, and kept by --resume (bit-exact with a run that was never interrupted).

The winner is planted (fp32 made slow on purpose), so what is tested is what auto does with a measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli_train import FAST

from mixprec.cli.main import main
from mixprec.precision import registry
from mixprec.precision.mixed import Bf16MixedPrecision
from mixprec.trainer import checkpointing
from planted_precisions import SleepyFp32

AUTO = [*FAST[:-2], "--precision", "auto"]
pytestmark = pytest.mark.usefixtures("quick_train_cli")  # conftest.py: tmp_path as cwd, a short sample, one thread


@pytest.fixture
def bf16_wins(monkeypatch):
    monkeypatch.setattr(registry, "auto_candidates", lambda device: [SleepyFp32(device), Bf16MixedPrecision(device)])
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "aside")  # these runs of 2-4 steps would keep fp32 unraced


def _events(run: Path, name: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def test_auto_races_on_the_real_step_and_says_so_everywhere(tmp_path, corpus, capsys, bf16_wins):
    run = tmp_path / "run"
    assert main(["train", "--data", corpus, *AUTO, "--max-steps", "2", "--output-dir", str(run)]) == 0
    out, err = capsys.readouterr()
    # issue 29, one story per run: the decision told once on stderr, on a line of its own (stderr is not a
    # terminal here, as in a log file: progress comes as whole lines, no carriage returns), once in the summary
    assert err.count("raced the candidates") == 1 and out.count("raced the candidates") == 1
    (decision,) = [line for line in err.splitlines() if "raced the candidates" in line]
    assert decision.startswith("mixprec: bf16 on cpu") and "\r" not in err
    assert any(line.startswith("train: 2/2 steps") for line in err.splitlines())
    # one train-loss figure, with its definition, the same on stderr and in the summary
    (loss_line,) = [line for line in err.splitlines() if "train loss" in line]
    figure = loss_line.split("train loss ")[1].split()[0]
    (row,) = [line for line in out.splitlines() if line.startswith("train loss")]
    assert f"{figure} nats/byte" in row and "the mean over the 2 steps this run took" in row
    assert "precision         bf16: auto on cpu raced the candidates on the training step" in out
    assert "auto: fp32" in out and "auto: bf16" in out and "<- chosen" in out
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["auto_precision"]["chosen"] == "bf16"
    assert set(summary["auto_precision"]["step_seconds"]) == {"fp32", "bf16"}
    (event,) = _events(run, "auto_precision")
    assert event["chosen"] == "bf16" and event["source"] == "measured" and event["step"] == 0
    meta = json.loads((run / "checkpoint-2" / "accelerator.json").read_text())
    assert meta["mixed_precision"] == "bf16" and meta["auto"]["chosen"] == "bf16"


class Crash(Exception):
    """A process that dies right after its checkpoint at step 2 (what a kill -9 there leaves)."""


def test_resume_keeps_the_decision_and_is_bit_exact(tmp_path, corpus, capsys, bf16_wins, monkeypatch):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    argv = ["train", "--data", corpus, *AUTO, "--epochs", "2"]  # two epochs of two steps
    assert main([*argv, "--output-dir", str(straight)]) == 0

    save = checkpointing.save_trainer_checkpoint

    def save_then_crash(trainer, *args, **kwargs):
        out = save(trainer, *args, **kwargs)
        if trainer.state.global_step == 2:
            raise Crash
        return out

    monkeypatch.setattr(checkpointing, "save_trainer_checkpoint", save_then_crash)
    with pytest.raises(Crash):
        main([*argv, "--output-dir", str(crashed)])
    monkeypatch.setattr(checkpointing, "save_trainer_checkpoint", save)

    def no_race(*args, **kwargs):
        raise AssertionError("a resumed run must keep its recorded decision, not race again")

    monkeypatch.setattr("mixprec.precision.auto.decide", no_race)
    capsys.readouterr()
    assert main(["train", "--resume", str(crashed)]) == 0
    assert "bf16: auto on cpu kept the checkpoint's decision" in capsys.readouterr().out
    assert len(_events(crashed, "auto_precision")) == 1  # measured once, in the first invocation
    a = load_file(straight / "checkpoint-4" / "model.safetensors")
    b = load_file(crashed / "checkpoint-4" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
