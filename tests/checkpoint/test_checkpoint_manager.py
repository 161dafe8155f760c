"""checkpoint/manager.py: one owner of a run's checkpoint folders. Old folders are deleted only once the new one
has landed (an asynchronous save's too), by the writer thread, never the training thread; one keep-k policy
for every naming; and the watch's capsules count checkpoints as the Trainer does."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixprec import Accelerator, ProjectConfiguration, Trainer, TrainingArguments
from mixprec.checkpoint import atomic_dir, write_manifest
from mixprec.checkpoint.folders import NumberedFolders
from mixprec.watch.capsule import write_capsule
from trainer_utils import make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def _numbered(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if p.name.startswith("checkpoint")), key=lambda n: int(n[11:]))


@pytest.fixture
def held_writer(monkeypatch):
    """Every safetensors file the writer thread writes waits on an event: a save that has not landed yet."""
    gate, real = threading.Event(), safetensors.torch.save_file

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", slow)
    return gate


@pytest.fixture
def deleting_threads(monkeypatch) -> list[str]:
    """The name of the thread that deletes each pruned checkpoint folder."""
    seen, real = [], shutil.rmtree

    def spy(path, *args, **kwargs):
        if Path(path).name.endswith(".deleting"):
            seen.append(threading.current_thread().name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", spy)
    return seen


def test_an_async_save_prunes_only_after_its_folder_has_landed(tmp_path, held_writer, deleting_threads):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config, verbose=False)
    model = acc.prepare(torch.nn.Linear(4, 4))
    held_writer.set()
    acc.save_state()
    acc.save_state()
    held_writer.clear()
    acc.save_state(async_save=True)  # checkpoint_2, held back by the planted slow writer
    root = tmp_path / "checkpoints"
    assert _numbered(root) == ["checkpoint_0", "checkpoint_1"]  # both kept while the new one is not there
    assert not deleting_threads
    model(torch.ones(1, 4))  # training goes on meanwhile
    held_writer.set()
    acc.wait_for_checkpoint()
    assert _numbered(root) == ["checkpoint_1", "checkpoint_2"]  # total_limit holds once it has landed
    assert deleting_threads and threading.main_thread().name not in deleting_threads


def test_the_trainer_deletes_old_checkpoints_off_the_training_thread(tmp_path, deleting_threads):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_plots=False,
        max_steps=4,
        save_steps=1,
        save_total_limit=1,
        per_device_train_batch_size=4,
    )
    Trainer(make_model(), args, train_dataset=make_examples(16)).train()
    assert _numbered(tmp_path) == ["checkpoint-4"]
    assert len(deleting_threads) == 3 and threading.main_thread().name not in deleting_threads, deleting_threads


def test_keep_one_with_an_older_protected_folder_keeps_the_newest_too(tmp_path):
    """HF's rule for save_total_limit=1 with a best checkpoint that is not the last: both stay. It is the
    policy of every naming (it lived in the Trainer's wrapper, so the shared prune deleted the newest)."""
    folders = NumberedFolders(tmp_path, "step-")
    for n in (1, 2, 3):
        with atomic_dir(tmp_path / f"step-{n}") as tmp:
            (tmp / "a.txt").write_text(str(n))
            write_manifest(tmp)
    folders.prune(1, protect=tmp_path / "step-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-3"]


def test_a_capsule_names_the_checkpoint_the_trainer_would_resume_from(tmp_path):
    files = ("accelerator.json", "trainer_state.json", "trainer_extra.json")
    with atomic_dir(tmp_path / "checkpoint-1") as tmp:
        for name in files:
            (tmp / name).write_text("{}")
        write_manifest(tmp)
    (tmp_path / "checkpoint-2").mkdir()  # no manifest, none of the Trainer's files: not a checkpoint
    (tmp_path / "checkpoint-2" / "notes.txt").write_text("someone's folder")
    model = torch.nn.Linear(2, 2)
    capsule = write_capsule(
        tmp_path,
        step=3,
        reason="nonfinite",
        model=model,
        batches=[{"x": torch.ones(2)}],
        rng=(torch.get_rng_state(), None),
        precision="fp16",
        loss=None,
        loss_scale=1.0,
        fallbacks=[],
        optimizer=None,
    )
    reference = json.loads((capsule / "capsule.json").read_text())["state_reference"]
    assert reference["latest_checkpoint"] == "checkpoint-1"
