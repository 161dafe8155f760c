"""checkpoint/folders.py: the one numbered-folder policy behind both namings (the Trainer's checkpoint-N and
the Accelerator's automatic checkpoints/checkpoint_N): a damaged folder is skipped by both, pruning keeps the
newest complete ones and never leaves a half-deleted folder under a checkpoint's name, and a commit a crash
interrupted is finished before listing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mixprec import Accelerator, ProjectConfiguration
from mixprec.checkpoint import atomic_dir, write_manifest
from mixprec.checkpoint.atomic import begin, temp_path
from mixprec.checkpoint.folders import NumberedFolders, automatic_folders, trainer_folders


def _write(root: Path, name: str, files: dict[str, str]) -> Path:
    with atomic_dir(root / name) as tmp:
        for rel, text in files.items():
            (tmp / rel).write_text(text)
        write_manifest(tmp)
    return root / name


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(1)


def test_latest_skips_a_folder_whose_file_lost_bytes(tmp_path: Path) -> None:
    folders = NumberedFolders(tmp_path, "step-", required=("meta.json",))
    for n in (1, 2, 10):  # 10 sorts before 2 as text: the number decides
        _write(tmp_path, f"step-{n}", {"meta.json": "{}", "weights.bin": "x" * 64})
    assert folders.latest() == tmp_path / "step-10"
    _truncate(tmp_path / "step-10" / "weights.bin")
    assert [p.name for p in folders.complete()] == ["step-1", "step-2"]
    assert folders.latest() == tmp_path / "step-2"
    assert [p.name for p in folders.numbered()] == ["step-1", "step-2", "step-10"]  # still there, for a report


def test_a_folder_without_a_required_file_is_not_complete(tmp_path: Path) -> None:
    folders = NumberedFolders(tmp_path, "step-", required=("meta.json",))
    _write(tmp_path, "step-3", {"weights.bin": "x"})  # a manifest that does not list meta.json
    (tmp_path / "step-4").mkdir()  # no manifest and no legacy files: somebody's empty folder
    assert folders.latest() is None


def test_prune_keeps_the_newest_and_the_protected_one_and_renames_before_deleting(tmp_path: Path) -> None:
    folders = NumberedFolders(tmp_path, "step-")
    for n in range(1, 6):
        _write(tmp_path, f"step-{n}", {"a.txt": str(n)})
    (tmp_path / ".step-9.deleting").mkdir()  # a delete a kill interrupted earlier
    removed = folders.prune(3, protect=tmp_path / "step-1")  # 3 in all, the protected one among them
    assert [p.name for p in removed] == ["step-2", "step-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-4", "step-5"]
    assert folders.prune(None) == []


def test_recover_finishes_a_commit_a_crash_interrupted(tmp_path: Path) -> None:
    folders = NumberedFolders(tmp_path, "checkpoint-")
    _write(tmp_path, "checkpoint-4", {"a.txt": "old"})
    os.rename(tmp_path / "checkpoint-4", tmp_path / ".checkpoint-4.old")  # killed between commit's renames
    assert folders.latest() is None and folders.has_any()
    folders.recover()
    assert folders.latest() == tmp_path / "checkpoint-4"


def test_the_trainer_naming_needs_the_trainer_files(tmp_path: Path) -> None:
    _write(tmp_path, "checkpoint-2", {"accelerator.json": "{}"})  # a save_state folder, not a Trainer's
    _write(
        tmp_path, "checkpoint-1", {n: "{}" for n in ("accelerator.json", "trainer_state.json", "trainer_extra.json")}
    )
    assert trainer_folders(tmp_path).latest() == tmp_path / "checkpoint-1"


def test_accelerator_load_state_skips_a_damaged_automatic_checkpoint(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=3)
    acc = Accelerator(project_config=config, verbose=False)
    model = acc.prepare(torch.nn.Linear(3, 2))
    for value in range(3):
        with torch.no_grad():
            model.weight.fill_(value)
        acc.save_state()
    _truncate(tmp_path / "checkpoints" / "checkpoint_2" / "model.safetensors")  # the newest lost its tail
    acc.load_state()
    assert torch.all(model.weight == 1)  # the newest intact one, not an error and not the damaged one


def test_accelerator_load_state_with_only_damaged_checkpoints_says_so(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    acc = Accelerator(project_config=config, verbose=False)
    acc.prepare(torch.nn.Linear(3, 2))
    acc.save_state()
    _truncate(tmp_path / "checkpoints" / "checkpoint_0" / "accelerator.json")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint_<n> folder .*1 incomplete or damaged"):
        acc.load_state()


@pytest.mark.parametrize("folders", [trainer_folders, automatic_folders])
def test_a_file_a_failed_save_was_writing_names_the_folder_it_was_for(tmp_path, folders) -> None:
    # a full disk during an asynchronous save reports the file; the message names the checkpoint it was for
    numbered = folders(tmp_path)
    tmp = begin(numbered.folder(4))  # the unfinished folder, under atomic.py's own naming
    assert numbered.unfinished_holding(tmp / "optimizer.pt") == numbered.folder(4)
    assert numbered.unfinished_holding(temp_path(numbered.folder(12), "77-ab") / "sub" / "x.bin") == numbered.folder(12)
    assert numbered.unfinished_holding(numbered.folder(4) / "optimizer.pt") is None  # a finished folder's file
    assert numbered.unfinished_holding(begin(tmp_path / "other-3") / "x") is None  # not one of these folders
    assert numbered.unfinished_holding(None) is None
