"""Checkpoints: nothing lost, nothing unpickled.

Hard kills run in subprocesses (tests/trainer/trainer_kill_script.py): a kill -9 between checkpoints (fp16), a kill
-9 in the middle of writing a checkpoint (fp32), and a SIGTERM (fp16). The three are launched together, so
their torch imports overlap; each resumed run is finished here and compared, bit for bit, with an
uninterrupted run computed in this process with the same code and thread count.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_kill_script import MAX_STEPS, SAVE_STEPS, build_trainer

from mixprec import Trainer, TrainingArguments
from mixprec.checkpoint import CheckpointError, UnsafeCheckpointError, load_tensors, write_manifest
from mixprec.checkpoint.folders import trainer_folders
from mixprec.trainer.logging import read_metrics
from trainer_utils import assert_bit_identical, flat_params, make_examples, make_model

SCRIPT = Path(__file__).with_name("trainer_kill_script.py")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


# -- the subprocess kills ------------------------------------------------------------------------------


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"{SCRIPT.name} exited ({proc.returncode}) before {path.name}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {path}")
        time.sleep(0.05)


def _reference_runs(base: Path) -> dict[str, dict[str, torch.Tensor]]:
    final = {}
    for precision in ("fp32", "fp16"):
        trainer = build_trainer(base / f"ref-{precision}", precision)
        trainer.train()
        final[precision] = flat_params(trainer.model)
    return final


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The three interrupted runs, name -> (folder, exit status, log), and under "reference" the final
    parameters of uninterrupted runs per precision (computed here while the subprocesses start up)."""
    base = tmp_path_factory.mktemp("kills")
    specs = {  # name: (precision, mode, marker that says "now", signal)
        "kill": ("fp16", "victim", "ready", signal.SIGKILL),
        "kill-in-save": ("fp32", "save-victim", "saving", signal.SIGKILL),
        "term": ("fp16", "sigterm", "ready", signal.SIGTERM),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = {}
    for name, (precision, mode, _, _) in specs.items():
        out = base / name
        out.mkdir()
        log = (out / "log.txt").open("w")
        cmd = [sys.executable, str(SCRIPT), str(out), precision, mode]
        running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), out)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the subprocesses' arithmetic
    try:
        results: dict = {"reference": _reference_runs(base)}
    finally:
        torch.set_num_threads(n)
    for name, (proc, out) in running.items():
        _wait_for(out / specs[name][2], proc, out / "log.txt")
        proc.send_signal(specs[name][3])
        (out / "signalled").touch()  # lets a run that survives the signal go on
    for name, (proc, out) in running.items():
        proc.wait(timeout=120)
        results[name] = (out, proc.returncode, (out / "log.txt").read_text())
    return results


def _resume(out: Path, precision: str) -> Trainer:
    trainer = build_trainer(out, precision)
    trainer.train(resume_from_checkpoint=True)
    return trainer


def test_resume_after_kill_9_is_bit_identical_fp16(runs):
    out, status, _ = runs["kill"]
    assert status == -signal.SIGKILL
    start = trainer_folders(out / "run").latest()
    assert start is not None and start.name == f"checkpoint-{SAVE_STEPS}"  # killed before the next one
    logged = [e["step"] for e in read_metrics(out / "run" / "metrics.jsonl") if "loss" in e]
    assert logged == list(range(1, SAVE_STEPS + 2))  # one step past the checkpoint, then killed
    trainer = _resume(out, "fp16")
    assert trainer.state.global_step == MAX_STEPS
    assert_bit_identical(flat_params(trainer.model), runs["reference"]["fp16"])
    # the killed run had logged a step past its checkpoint; the log now holds each step once, as resumed
    entries = read_metrics(out / "run" / "metrics.jsonl")
    assert [e["step"] for e in entries if "loss" in e] == list(range(1, MAX_STEPS + 1))
    assert [e["loss"] for e in entries if "loss" in e] == [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable_fp32(runs):
    out, status, _ = runs["kill-in-save"]
    assert status == -signal.SIGKILL
    run = out / "run"
    assert [p.name for p in trainer_folders(run).complete()] == [f"checkpoint-{SAVE_STEPS}"]
    assert not (run / f"checkpoint-{2 * SAVE_STEPS}").exists()  # the half-written one never took the name
    assert list(run.glob(f".checkpoint-{2 * SAVE_STEPS}.tmp-*")), "the kill should have left the staging folder"
    trainer = _resume(out, "fp32")
    assert_bit_identical(flat_params(trainer.model), runs["reference"]["fp32"])
    assert not list(run.glob(".checkpoint-*")), "the next save of that step cleans the litter up"


def test_sigterm_saves_at_the_next_step_boundary_and_exits_cleanly(runs):
    out, status, log = runs["term"]
    assert status == 128 + signal.SIGTERM, log[-2000:]
    assert "Traceback" not in log
    assert "stopped by signal 15" in log
    saved = trainer_folders(out / "run").latest()
    state = json.loads((saved / "trainer_state.json").read_text())
    assert saved.name == "checkpoint-2" and state["global_step"] == 2  # the step the signal arrived in
    trainer = _resume(out, "fp16")  # and the checkpoint it took continues exactly
    assert_bit_identical(flat_params(trainer.model), runs["reference"]["fp16"])


# -- in-process resumes --------------------------------------------------------------------------------


def _args(out: Path, **kwargs) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "disable_tqdm": True,
        "save_plots": False,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 4,
    }
    return TrainingArguments(**{**base, **kwargs})


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_resume_from_every_checkpoint_matches_the_uninterrupted_run(tmp_path, precision):
    # 5 batches per epoch, accumulation 2: steps end mid-epoch (2, 4) and at epoch ends (3, 6)
    kw = {"precision": precision, "max_steps": 6, "save_steps": 1, "gradient_accumulation_steps": 2}
    full = Trainer(make_model(), _args(tmp_path / "full", **kw), train_dataset=make_examples(20))
    full.train()
    for step in (2, 3, 4):
        args = _args(tmp_path / f"from{step}", **{**kw, "save_strategy": "no"})
        resumed = Trainer(make_model(seed=1), args, train_dataset=make_examples(20))
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        assert_bit_identical(flat_params(resumed.model), flat_params(full.model))
        # the log of the resumed run continues the same history: same losses, same learning rates (all
        # but the closing train_runtime entry, a measurement)
        assert resumed.state.log_history[:-1] == full.state.log_history[:-1]
        assert "train_runtime" in resumed.state.log_history[-1]


def test_resume_at_an_epochs_last_step_still_runs_that_epochs_end(tmp_path):
    # checkpoint-5 is the last step of epoch 1, saved before the epoch's evaluation: a resume from it must
    # evaluate epoch 1 before training epoch 2, as the uninterrupted run did
    kw = {"num_train_epochs": 3, "save_steps": 1, "eval_strategy": "epoch"}
    data, val = make_examples(20), make_examples(8, 1)
    full = Trainer(make_model(), _args(tmp_path / "full", **kw), train_dataset=data, eval_dataset=val)
    full.train()
    args = _args(tmp_path / "resumed", **{**kw, "save_strategy": "no"})
    resumed = Trainer(make_model(seed=1), args, train_dataset=data, eval_dataset=val)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-5"))

    def measured(history):  # the entries without wall-clock timings
        return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in history[:-1]]

    assert [(e["step"], e["epoch"]) for e in resumed.state.log_history if "eval_loss" in e] == [
        (5, 1.0),
        (10, 2.0),
        (15, 3.0),
    ]
    assert measured(resumed.state.log_history) == measured(full.state.log_history)
    assert_bit_identical(flat_params(resumed.model), flat_params(full.model))


def test_checkpoint_layout_is_safe_formats_and_hf_readable(tmp_path):
    trainer = Trainer(
        make_model(), _args(tmp_path, fp16=True, max_steps=2, save_steps=2), train_dataset=make_examples(16)
    )
    trainer.train()
    ckpt = tmp_path / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "scaler.json", "rng_state_0.pt"} <= names
    assert {"trainer_state.json", "trainer_extra.json", "training_args.json", "accelerator.json"} <= names
    transformers = pytest.importorskip("transformers")
    state = transformers.TrainerState.load_from_json(str(ckpt / "trainer_state.json"))  # HF reads ours
    assert state.global_step == 2 and state.log_history == trainer.state.log_history[:-1]
    assert set(load_tensors(ckpt / "model.safetensors")) == set(trainer.model.state_dict())


class Trap:
    """Unpickling this creates ``path``: what a booby-trapped checkpoint would do with os.system instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("victim", ["optimizer.pt", "scheduler.pt", "rng_state_0.pt"])
def test_a_booby_trapped_pickle_in_a_checkpoint_is_never_executed(tmp_path, victim):
    trainer = Trainer(make_model(), _args(tmp_path / "a", max_steps=2, save_steps=2), train_dataset=make_examples(16))
    trainer.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    marker = tmp_path / "pwned"
    torch.save({"state": Trap(str(marker))}, ckpt / victim)  # where the real state would be
    write_manifest(ckpt)  # whoever planted it can update the checksums too
    resumed = Trainer(make_model(), _args(tmp_path / "b", max_steps=4), train_dataset=make_examples(16))
    with pytest.raises(UnsafeCheckpointError, match=rf"refusing to load .*{victim}.*arbitrary code"):
        resumed.train(resume_from_checkpoint=str(ckpt))
    assert not marker.exists(), "the pickle's code ran"


def test_a_corrupt_trainer_state_is_a_clear_error(tmp_path):
    trainer = Trainer(make_model(), _args(tmp_path / "a", max_steps=2, save_steps=2), train_dataset=make_examples(16))
    trainer.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    (ckpt / "trainer_state.json").write_text("{not json")
    resumed = Trainer(make_model(), _args(tmp_path / "b", max_steps=4), train_dataset=make_examples(16))
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        resumed.train(resume_from_checkpoint=str(ckpt))


def test_a_resume_onto_smaller_training_data_names_the_change(tmp_path):
    # it said the checkpoint "was written by an incompatible version", printing two identical positions
    trainer = Trainer(make_model(), _args(tmp_path / "a", max_steps=3, save_steps=3), train_dataset=make_examples(32))
    trainer.train()
    smaller = Trainer(make_model(), _args(tmp_path / "a", max_steps=6), train_dataset=make_examples(8))
    with pytest.raises(CheckpointError, match=r"saved 3 batches into epoch 0, and an epoch now holds 2: the training"):
        smaller.train(resume_from_checkpoint=True)


def test_resume_true_takes_the_latest_complete_checkpoint(tmp_path):
    out = tmp_path / "out"
    Trainer(make_model(), _args(out, max_steps=3, save_steps=1), train_dataset=make_examples(16)).train()
    (out / "checkpoint-3" / "trainer_extra.json").unlink()  # damaged: not complete
    shutil.copytree(out / "checkpoint-2", out / ".checkpoint-4.tmp-123")  # a crashed save's staging folder
    assert not trainer_folders(out).is_complete(out / "checkpoint-3")
    assert trainer_folders(out).resolve_resume(True) == out / "checkpoint-2"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        trainer_folders(out).resolve_resume(str(out / "checkpoint-3"))
    with pytest.raises(ValueError, match="no complete checkpoint-N folder"):
        trainer_folders(tmp_path / "empty").resolve_resume(True)
    trainer = Trainer(make_model(), _args(out, max_steps=4, save_steps=1), train_dataset=make_examples(16))
    trainer.train(resume_from_checkpoint=True)
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3, 4]


def test_save_total_limit_prunes_only_old_complete_checkpoints(tmp_path):
    args = _args(tmp_path, max_steps=5, save_steps=1, save_total_limit=2)
    Trainer(make_model(), args, train_dataset=make_examples(16)).train()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("checkpoint-", ".checkpoint-"))) == [
        "checkpoint-4",
        "checkpoint-5",
    ]


def test_load_best_model_at_end_keeps_and_restores_the_best_checkpoint(tmp_path):
    args = _args(
        tmp_path,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        learning_rate=0.5,  # large enough that the eval loss is not monotone
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(16), eval_dataset=make_examples(8, 1))
    trainer.train()
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best_step = min(evals, key=evals.get)
    assert trainer.state.best_metric == evals[best_step] and trainer.state.best_global_step == best_step
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_step}")
    kept = {p.name for p in trainer_folders(tmp_path).complete()}
    assert kept == {f"checkpoint-{best_step}", "checkpoint-6"} if best_step != 6 else {"checkpoint-6"}
    weights = load_tensors(tmp_path / f"checkpoint-{best_step}" / "model.safetensors")
    assert_bit_identical(flat_params(trainer.model), weights)


def test_save_model_writes_safetensors(tmp_path):
    trainer = Trainer(make_model(), _args(tmp_path, max_steps=1, save_strategy="no"), train_dataset=make_examples(8))
    trainer.train()
    path = trainer.save_model(str(tmp_path / "final"))
    assert_bit_identical(load_tensors(path / "model.safetensors"), flat_params(trainer.model))


def test_a_first_ctrl_c_saves_and_stops_and_a_second_stops_at_once(tmp_path, capsys):
    # Ctrl-C ended the run at once with no checkpoint ("mixprec: interrupted", exit 130): an hour's steps since
    # the last epoch's save were lost
    from mixprec import TrainerCallback, TrainingInterrupted
    from mixprec.trainer.signals import GracefulStop

    class CtrlC(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "out"
    trainer = Trainer(
        make_model(), _args(out, max_steps=6, save_strategy="no"), train_dataset=make_examples(32), callbacks=[CtrlC()]
    )
    with pytest.raises(TrainingInterrupted) as stop:
        trainer.train()
    assert stop.value.exit_status == 130 and stop.value.step == 2 and (out / "checkpoint-2").is_dir()
    assert "Ctrl-C again: at once" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back
    with GracefulStop() as stop_flag, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # the first: a request
        assert stop_flag.requested
        os.kill(os.getpid(), signal.SIGINT)  # the second: at once
