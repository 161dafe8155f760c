"""Issue 14's faults as a command-line user meets them: each ends in one line naming the file or flag and
what to do, exit status 2, no traceback; or, where there is an intact checkpoint, a resume from it.

Numbers refer to the issue's list (1 two runs in one folder, 2 a crash between a save's renames, 5 a failed
--resume rewriting config.toml, 6 damaged files, 7 filesystem faults, 9 the small items). Tiny GPT, 32-byte
sequences, 2 steps per epoch, a checkpoint per epoch.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec.trainer.loop as loop_module
from mixprec.cli.main import main

FAST = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--epoch-tokens", "256", "--precision", "fp32"]


pytestmark = pytest.mark.usefixtures("quick_train_cli")  # conftest.py: tmp_path as cwd, a short sample, one thread


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A finished 4-step run (2 epochs): checkpoint-2 and checkpoint-4. Tests copy it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert main(["train", "--data", corpus, *FAST, "--epochs", "2", "--output-dir", str(run)]) == 0
    torch.set_num_threads(threads)
    return run


def _copy(run: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(run, dst, ignore=shutil.ignore_patterns(".mixprec.lock"))
    return dst


def _one_error_line(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mixprec train: error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# -- 1 ---------------------------------------------------------------------------------------------------


def test_1_a_second_run_into_a_folder_in_use_is_refused_in_one_line(tmp_path, finished, capsys):
    run = _copy(finished, tmp_path / "run")
    code = (
        "import sys; from mixprec.checkpoint import lock_folder; lock_folder(sys.argv[1]); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"locked"
    try:
        config = (run / "config.toml").read_bytes()
        assert main(["train", "--resume", str(run), "--epochs", "3"]) == 2
        _one_error_line(capsys, str(run), f"in use by another run (process {holder.pid})")
        assert (run / "config.toml").read_bytes() == config
        assert not (run / "checkpoint-6").exists()
    finally:
        holder.communicate(b"")


# -- 2 ---------------------------------------------------------------------------------------------------


def test_2_a_crash_between_a_saves_renames_is_seen_by_resume_and_by_a_fresh_run(tmp_path, finished, corpus, capsys):
    run = _copy(finished, tmp_path / "run")
    os.rename(run / "checkpoint-4", run / ".checkpoint-4.old")  # killed between commit's two renames
    assert main(["train", "--resume", str(run), "--max-steps", "5"]) == 0
    assert "resuming from checkpoint-4" in capsys.readouterr().out

    only = _copy(finished, tmp_path / "only")
    import shutil

    shutil.rmtree(only / "checkpoint-2")
    os.rename(only / "checkpoint-4", only / ".checkpoint-4.old")
    assert main(["train", "--data", corpus, *FAST, "--output-dir", str(only)]) == 2
    _one_error_line(capsys, "already holds a run")


# -- 5 ---------------------------------------------------------------------------------------------------


def test_5_a_failed_resume_leaves_config_toml_as_it_was(tmp_path, finished, capsys):
    run = _copy(finished, tmp_path / "run")
    config = (run / "config.toml").read_bytes()
    assert main(["train", "--resume", str(run), "--model", "small"]) == 2
    _one_error_line(capsys, "model.safetensors", "does not fit the prepared model")
    assert (run / "config.toml").read_bytes() == config
    assert main(["train", "--resume", str(run), "--epochs", "3"]) == 0  # the documented command still works


# -- 6 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("victim", "damage"),
    [("rng_state_0.pt", "truncate"), ("trainer_state.json", "flip"), ("model.safetensors", "flip")],
)
def test_6_a_damaged_newest_checkpoint_is_skipped_with_a_warning_line(tmp_path, finished, capsys, victim, damage):
    run = _copy(finished, tmp_path / "run")
    path = run / "checkpoint-4" / victim
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x80
    path.write_bytes(bytes(data))
    assert main(["train", "--resume", str(run), "--max-steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "resuming from checkpoint-2" in captured.out
    warning = [line for line in captured.err.splitlines() if line.startswith("mixprec: warning: skipped")]
    assert len(warning) == 1 and f"checkpoint-4: {victim}" in warning[0], captured.err
    assert "Traceback" not in captured.err


def test_6_a_damaged_checkpoint_named_on_the_command_line_is_one_line(tmp_path, finished, capsys):
    run = _copy(finished, tmp_path / "run")
    path = run / "checkpoint-4" / "scheduler.pt"
    path.write_bytes(path.read_bytes()[:-10])
    assert main(["train", "--resume", str(run / "checkpoint-4")]) == 2
    _one_error_line(capsys, "scheduler.pt has", "the manifest says", "pass the run folder")


def test_6_no_intact_checkpoint_left_is_one_line(tmp_path, finished, capsys):
    run = _copy(finished, tmp_path / "run")
    for name in ("checkpoint-2", "checkpoint-4"):
        (run / name / "accelerator.json").write_bytes(b"\xff\xfe")
    assert main(["train", "--resume", str(run)]) == 2
    _one_error_line(capsys, "no intact checkpoint-N folder", "checkpoint-4: accelerator.json")


# -- 7 ---------------------------------------------------------------------------------------------------


def test_7_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(
    tmp_path, corpus, capsys, monkeypatch
):
    run = tmp_path / "run"
    real_save = torch.save

    def full_disk_after_the_first_checkpoint(obj, f, *args, **kwargs):  # the writer of every .pt file
        if (run / "checkpoint-2").is_dir() and Path(f).name.startswith(".optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_after_the_first_checkpoint)
    assert main(["train", "--data", corpus, *FAST, "--epochs", "2", "--output-dir", str(run)]) == 2
    _one_error_line(
        capsys, "disk full: checkpoint-4 could not be saved", "checkpoint-2, is intact", f"mixprec train --resume {run}"
    )
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    assert "resuming from checkpoint-2" in capsys.readouterr().out


def test_7_a_read_only_run_folder_is_one_line(tmp_path, finished, capsys, monkeypatch):
    run = _copy(finished, tmp_path / "run")
    import mixprec.checkpoint.lock as lock_module

    def read_only(path, *args, **kwargs):  # what open() says on a read-only mount (root ignores chmod)
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(lock_module, "open", read_only, raising=False)
    assert main(["train", "--resume", str(run), "--epochs", "3"]) == 2
    _one_error_line(capsys, str(run), "read-only file system", "choose a writable folder")


def test_7_an_output_dir_that_is_a_file_is_one_line(tmp_path, corpus, capsys):
    (tmp_path / "taken").write_text("not a folder")
    assert main(["train", "--data", corpus, *FAST, "--max-steps", "1", "--output-dir", str(tmp_path / "taken")]) == 2
    _one_error_line(capsys, "--output-dir", "is a file, not a folder")


def test_7_an_undecodable_folder_name_is_one_line_and_writes_nothing(tmp_path, corpus, capsys):
    name = os.fsdecode(b"run-\xff")  # a name that is not UTF-8 arrives as a lone surrogate
    assert main(["train", "--data", corpus, *FAST, "--max-steps", "1", "--output-dir", name]) == 2
    _one_error_line(capsys, "--output-dir", "not valid UTF-8")
    assert list(tmp_path.iterdir()) == []


def test_7_a_config_that_is_a_folder_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path)]) == 2
    _one_error_line(capsys, f"--config {tmp_path}", "a folder, not a file")


# -- 9 ---------------------------------------------------------------------------------------------------


def test_9_a_seed_past_64_bits_is_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--seed", str(2**64)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed: must be at most 2**64 - 1" in err and "Traceback" not in err


def test_9_sigterm_tells_a_command_line_user_the_command_to_resume(tmp_path, corpus, capsys, monkeypatch):
    class SignalAfterFirstStep(loop_module.GracefulStop):
        def agreed(self, reduce_max=None):  # as if SIGTERM arrived during step 1
            self.received = 15
            return True

    monkeypatch.setattr(loop_module, "GracefulStop", SignalAfterFirstStep)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", corpus, *FAST, "--max-steps", "4", "--output-dir", str(run)])
    assert exc.value.code == 143
    err = capsys.readouterr().err
    assert f"resume with mixprec train --resume {run}" in err
    assert "trainer.train(" not in err
    assert (run / "checkpoint-1").is_dir()


def test_9_a_resume_into_another_precision_warns_on_stderr(tmp_path, finished, capsys):
    run = _copy(finished, tmp_path / "run")
    assert main(["train", "--resume", str(run), "--max-steps", "5", "--precision", "bf16"]) == 0
    err = capsys.readouterr().err
    assert any(
        line.startswith("mixprec: warning: ") and "saved under fp32" in line and "into bf16" in line
        for line in err.splitlines()
    ), err


def test_6_no_intact_checkpoint_left_says_each_reason_once(tmp_path, finished, capsys):
    # issue 34: the reason came twice, as a warning and again inside the error
    run = _copy(finished, tmp_path / "run")
    for name in ("checkpoint-2", "checkpoint-4"):
        (run / name / "accelerator.json").write_bytes(b"\xff\xfe")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("checkpoint-4: accelerator.json") == 1 and err.count("checkpoint-2: accelerator.json") == 1, err
