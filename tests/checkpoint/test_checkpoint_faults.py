"""Issue 14's faults at the library level (Trainer, Accelerator, checkpoint primitives), each reproduced.

Numbers refer to the issue's list: 1 two runs in one folder, 2 a crash between a save's renames, 3 a
checkpoint missing a file, 4 a load that fails part-way, 6 damaged files, 7 a full disk, 9 file modes.
The command line's side of the same faults is in test_cli_faults.py.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec.checkpoint.atomic as atomic_module
from mixprec import Trainer, TrainingArguments
from mixprec.checkpoint import CheckpointError, begin, load_json, load_torch, save_tensors, save_torch
from mixprec.checkpoint.folders import trainer_folders
from resumable_loop import run, setup
from trainer_utils import assert_bit_identical, flat_params, make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def _args(out: Path, **kwargs) -> TrainingArguments:
    base = {"output_dir": str(out), "disable_tqdm": True, "save_plots": False, "logging_steps": 1}
    base.update(learning_rate=1e-2, per_device_train_batch_size=4, max_steps=4, save_steps=2, seed=3)
    return TrainingArguments(**{**base, **kwargs})


def _trainer(out: Path, **kwargs) -> Trainer:
    return Trainer(make_model(), _args(out, **kwargs), train_dataset=make_examples(20))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """An uninterrupted 4-step run with checkpoint-2 and checkpoint-4: (its folder, its final parameters)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = _trainer(out)
    trainer.train()
    torch.set_num_threads(n)
    return out, flat_params(trainer.model)


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".mixprec.lock"))
    return dst


def _resume_to_4(out: Path) -> Trainer:
    """Resume the copied run from what find_resumable picks, training to step 4 without saving."""
    trainer = _trainer(out, save_strategy="no")
    trainer.train(resume_from_checkpoint=True)
    return trainer


# -- 1: one run per folder -----------------------------------------------------------------------------


# New names are imported inside the tests that need them, so that the others run, and fail, on the code
# before issue 14 (which is how each was checked to reproduce its fault).


def _hold_lock_in_subprocess(folder: Path) -> subprocess.Popen:
    code = (
        "import sys; from mixprec.checkpoint import lock_folder; lock_folder(sys.argv[1]); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_1_a_second_trainer_into_a_folder_in_use_is_refused_naming_the_process(tmp_path, reference):
    from mixprec.checkpoint import FolderInUseError

    out = _copy_run(reference[0], tmp_path / "run")

    def contents() -> dict[Path, int]:  # everything but the lock file the holder made
        return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != ".mixprec.lock"}

    before = contents()
    holder = _hold_lock_in_subprocess(out)
    try:
        with pytest.raises(FolderInUseError, match=rf"{out}.* in use by another run \(process {holder.pid}\)"):
            _trainer(out).train()
    finally:
        holder.communicate("")
    assert contents() == before  # nothing touched, metrics.jsonl included
    _trainer(tmp_path / "run", max_steps=5).train(resume_from_checkpoint=True)  # the holder is gone: free again


def test_1_the_lock_is_reentrant_in_a_process_and_released_by_the_os_on_kill(tmp_path):
    from mixprec.checkpoint import lock_folder

    with lock_folder(tmp_path), lock_folder(tmp_path):  # the CLI, then its Trainer
        pass
    holder = _hold_lock_in_subprocess(tmp_path)
    holder.kill()  # SIGKILL: no cleanup code runs
    holder.wait()
    with lock_folder(tmp_path):  # the OS released it
        assert (tmp_path / ".mixprec.lock").read_text().strip() == str(os.getpid())


def test_1_a_save_never_deletes_another_live_processs_temporary_folder(tmp_path):
    target = tmp_path / "checkpoint-2"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = tmp_path / f".checkpoint-2.tmp-{alive.pid}-0000abcd"
        theirs.mkdir()
        dead = tmp_path / ".checkpoint-2.tmp-mixprec-state"  # an older mixprec's fixed name: stale
        dead.mkdir()
        mine = begin(target)
        assert theirs.is_dir(), "a running process's save in progress was deleted"
        assert not dead.exists()
        assert mine.name.startswith(f".checkpoint-2.tmp-{os.getpid()}-")
    finally:
        alive.kill()
        alive.wait()


# -- 2: a crash between a save's two renames -------------------------------------------------------------


def test_2_a_crash_between_the_renames_is_recovered_before_the_listing(tmp_path, reference):
    out = _copy_run(reference[0], tmp_path / "run")
    os.rename(out / "checkpoint-4", out / ".checkpoint-4.old")
    found = trainer_folders(out).find_resumable()
    assert found.checkpoint == out / "checkpoint-4" and not found.skipped
    assert not (out / ".checkpoint-4.old").exists()


# -- 3: a checkpoint missing a file ----------------------------------------------------------------------


def test_3_a_checkpoint_missing_its_rng_state_is_skipped_and_the_resume_stays_exact(tmp_path, reference, caplog):
    out = _copy_run(reference[0], tmp_path / "run")
    (out / "checkpoint-4" / "rng_state_0.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer = _resume_to_4(out)
    assert "skipped damaged or incomplete checkpoints (checkpoint-4: rng_state_0.pt is missing)" in caplog.text
    assert "resuming from checkpoint-2" in caplog.text
    assert_bit_identical(flat_params(trainer.model), reference[1])  # from checkpoint-2, dropout and all


@pytest.mark.parametrize("victim", ["accelerator.json", "trainer_state.json"])
def test_3_a_checkpoint_missing_a_state_file_is_skipped_with_a_line_saying_so(tmp_path, reference, caplog, victim):
    out = _copy_run(reference[0], tmp_path / "run")
    (out / "checkpoint-4" / victim).unlink()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer = _resume_to_4(out)
    assert f"checkpoint-4: {victim} is missing" in caplog.text
    assert_bit_identical(flat_params(trainer.model), reference[1])


# -- 4: all-or-nothing loads -----------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "older-folder-without-manifest"])
def test_4_a_load_that_fails_part_way_changes_nothing(tmp_path, manifest):
    accelerator, model, optimizer, loader, scheduler = setup("fp32")
    run(accelerator, model, optimizer, loader, scheduler, stop_after=3)
    saved = accelerator.save_state(tmp_path / "state")
    scheduler_file = saved / "scheduler.pt"
    scheduler_file.write_bytes(scheduler_file.read_bytes()[:-40])  # truncated
    if not manifest:
        (saved / "manifest.json").unlink(missing_ok=True)
    run(accelerator, model, optimizer, loader, scheduler, stop_after=2)  # the live objects move on
    params, opt_state = flat_params(model), optimizer.state_dict()
    lr, scale, rng = scheduler.get_last_lr(), accelerator.scaler.state_dict(), torch.get_rng_state()
    with pytest.raises(CheckpointError, match="scheduler.pt"):
        accelerator.load_state(saved)
    assert_bit_identical(flat_params(model), params)
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][k]["exp_avg"], opt_state["state"][k]["exp_avg"]) for k in opt_state["state"])
    assert scheduler.get_last_lr() == lr and accelerator.scaler.state_dict() == scale
    assert torch.equal(torch.get_rng_state(), rng)


def test_4_a_model_that_does_not_fit_is_refused_before_anything_is_copied(tmp_path):
    import safetensors.torch as st

    accelerator, *_ = setup("fp32")
    saved = accelerator.save_state(tmp_path / "state")
    tensors = st.load_file(str(saved / "model.safetensors"))
    tensors["head.weight"] = tensors["head.weight"][:, :-1].contiguous()  # a wrong shape; "embed" still fits
    st.save_file(tensors, str(saved / "model.safetensors"))
    (saved / "manifest.json").unlink(missing_ok=True)  # as an older mixprec wrote it
    other, other_model, *_ = setup("fp32", seed=5)
    params = flat_params(other_model)
    with pytest.raises(CheckpointError, match=r"head.weight is \(16, 31\) there and \(16, 32\) here"):
        other.load_state(saved)
    assert_bit_identical(flat_params(other_model), params)  # torch would have copied embed.* first


# -- 6: damaged files ------------------------------------------------------------------------------------


def _flip_a_byte(path: Path, offset_from_end: int = 7) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01  # inside the tensor data (at the end of a safetensors file)
    path.write_bytes(bytes(data))


def test_6_a_flipped_bit_inside_a_tensor_is_caught_and_the_older_checkpoint_resumes_exactly(
    tmp_path, reference, caplog
):
    out = _copy_run(reference[0], tmp_path / "run")
    _flip_a_byte(out / "checkpoint-4" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer = _resume_to_4(out)
    assert "checkpoint-4: model.safetensors does not match its sha256 checksum" in caplog.text
    assert_bit_identical(flat_params(trainer.model), reference[1])


def test_6_damaged_files_without_a_manifest_raise_errors_that_name_them(tmp_path):
    bad_json = tmp_path / "trainer_state.json"
    bad_json.write_bytes(b'{"global_step": \xff2}')  # not UTF-8: a flipped high bit
    with pytest.raises(CheckpointError, match=r"trainer_state.json is not valid JSON"):
        load_json(bad_json)
    rng = tmp_path / "rng_state_0.pt"
    save_torch({"torch": torch.get_rng_state()}, rng)
    rng.write_bytes(rng.read_bytes()[:100])  # truncated: torch says "[Errno 22] Invalid argument"
    with pytest.raises(CheckpointError, match=r"rng_state_0.pt is not a readable torch file"):
        load_torch(rng)


def test_6_a_damaged_explicit_checkpoint_is_an_error_naming_the_file(tmp_path, reference):
    out = _copy_run(reference[0], tmp_path / "run")
    target = out / "checkpoint-4" / "optimizer.pt"
    target.write_bytes(target.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"optimizer.pt has \d+ bytes, the manifest says \d+"):
        _trainer(out).train(resume_from_checkpoint=str(out / "checkpoint-4"))


# -- 7: a full disk --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["ENOSPC", "torch-enforce-fail"])
def test_7_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, how):
    real_save = torch.save

    def full_disk_at_step_4(obj, f, *args, **kwargs):
        if Path(f).name.startswith(".optimizer.pt") and (tmp_path / "run" / "checkpoint-2").is_dir():
            if how == "ENOSPC":
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            monkeypatch.setattr(atomic_module.shutil, "disk_usage", lambda path: _NoSpace)  # what a full disk reports
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_at_step_4)
    with pytest.raises(OSError) as info:
        _trainer(tmp_path / "run").train()
    message = str(info.value)
    assert message.startswith("disk full: checkpoint-4 could not be saved")
    assert f"the previous checkpoint, {tmp_path / 'run' / 'checkpoint-2'}, is intact" in message
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    from mixprec.checkpoint import verify_manifest

    assert verify_manifest(tmp_path / "run" / "checkpoint-2") is None
    assert not (tmp_path / "run" / "checkpoint-4").exists()
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".checkpoint")] == []


class _NoSpace:
    free = 0


# -- 9: file modes ---------------------------------------------------------------------------------------


def test_9_every_checkpoint_file_gets_the_usual_mode(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    save_tensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    save_torch({"a": 1}, tmp_path / "optimizer.pt")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"model.safetensors": 0o666 & ~umask, "optimizer.pt": 0o666 & ~umask}


def test_manifest_lists_every_file_and_is_written_last(tmp_path):
    from mixprec.checkpoint import verify_manifest

    accelerator, *_ = setup("fp32")
    saved = accelerator.save_state(tmp_path / "state")
    listed = set(load_json(saved / "manifest.json")["files"])
    assert listed == {p.name for p in saved.iterdir()} - {"manifest.json"}
    assert verify_manifest(saved) is None


def test_a_checkpoint_written_before_manifests_is_accepted_with_a_warning(tmp_path, reference, caplog):
    out = _copy_run(reference[0], tmp_path / "run")
    for name in ("checkpoint-2", "checkpoint-4"):
        (out / name / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer = _resume_to_4(out)
    assert "checkpoint-4 has no manifest.json (written by an older mixprec)" in caplog.text
    assert_bit_identical(flat_params(trainer.model), reference[1])
    (out / "checkpoint-4" / "rng_state_0.pt").unlink()  # without a manifest, the required files still count
    assert trainer_folders(out).find_resumable().checkpoint == out / "checkpoint-2"
