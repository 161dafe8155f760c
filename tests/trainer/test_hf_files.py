"""A checkpoint folder holds the files HF's Trainer tests and tools look for, under HF's names (issue 34):
``training_args.bin``, ``rng_state.pth`` and an HF model's ``config.json``, each readable with
``torch.load(weights_only=True)`` (or as JSON), listed in mixprec's manifest, and never read back by mixprec."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mixprec import Trainer, TrainingArguments
from mixprec.checkpoint import CheckpointError, load_torch
from mixprec.checkpoint.folders import trainer_folders
from mixprec.trainer.hf_loggers import hf_logger
from trainer_utils import captured_records, make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def _train(out: Path, **kwargs) -> Trainer:
    args = TrainingArguments(
        str(out),
        disable_tqdm=True,
        save_plots=False,
        per_device_train_batch_size=4,
        max_steps=4,
        save_steps=2,
        **kwargs,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(16))
    trainer.train()
    return trainer


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_holds_hfs_files_loadable_with_weights_only(tmp_path, async_save):
    trainer = _train(tmp_path, async_save=async_save)
    ckpt = tmp_path / "checkpoint-2"
    # HF's check_saved_checkpoints list (tests/trainer/trainer_test_utils.py), and HF's single-process RNG name
    for name in ("model.safetensors", "training_args.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    args = torch.load(ckpt / "training_args.bin", weights_only=True)
    assert args == json.loads(json.dumps(trainer.args.to_dict()))  # the run's arguments, as plain values
    TrainingArguments(**{k: v for k, v in args.items() if k in TrainingArguments.__dataclass_fields__})
    rng = torch.load(ckpt / "rng_state.pth", weights_only=True)
    ours = load_torch(ckpt / "rng_state_0.pt")  # the same instant as mixprec's own RNG file
    assert torch.equal(rng["cpu"], ours["torch"])
    assert torch.equal(rng["numpy"][1], ours["numpy"]["keys"])
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"training_args.bin", "rng_state.pth"} <= set(files)  # checksummed with the rest
    assert trainer_folders(ckpt.parent).verify(ckpt) is None


def test_hfs_rng_loader_restores_the_generators_from_rng_state_pth(tmp_path):
    transformers = pytest.importorskip("transformers")
    _train(tmp_path)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    hf = transformers.Trainer(torch.nn.Linear(1, 1), transformers.TrainingArguments(str(tmp_path / "hf"), report_to=[]))
    hf._load_rng_state(str(tmp_path / "checkpoint-2"))  # HF's own resume code, weights_only inside
    after = (random.random(), np.random.rand(), torch.rand(1))
    hf._load_rng_state(str(tmp_path / "checkpoint-2"))
    assert after == (random.random(), np.random.rand(), torch.rand(1))


def test_an_hf_models_checkpoint_has_config_json_for_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    rows = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32} for _ in range(8)]
    args = TrainingArguments(
        str(tmp_path), disable_tqdm=True, save_plots=False, max_steps=2, save_steps=2, per_device_train_batch_size=4
    )
    Trainer(transformers.GPT2LMHeadModel(config), args, train_dataset=rows).train()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "checkpoint-2"))
    assert reloaded.config.n_embd == 16


def test_resume_from_a_missing_folder_says_hfs_words(tmp_path):
    fresh = Trainer(
        make_model(),
        TrainingArguments(str(tmp_path / "fresh"), disable_tqdm=True, save_plots=False),
        train_dataset=make_examples(16),
    )
    with pytest.raises(ValueError, match=r"^No valid checkpoint found in output directory \(.*fresh\)"):
        fresh.train(resume_from_checkpoint=True)
    trainer = _train(tmp_path)
    with pytest.raises(ValueError, match="^Can't find a valid checkpoint at .*checkpoint-2-bogus"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2-bogus"))
    (tmp_path / "checkpoint-2" / "trainer_extra.json").unlink()
    with pytest.raises(CheckpointError, match="^Can't find a valid checkpoint at .*checkpoint-2: .*trainer_extra.json"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_resume_with_changed_intervals_or_batch_size_warns_in_hfs_words(tmp_path):
    _train(tmp_path)  # save_steps 2, batch size 4
    args = TrainingArguments(
        str(tmp_path), disable_tqdm=True, save_plots=False, per_device_train_batch_size=2, max_steps=6, save_steps=3
    )
    with captured_records(hf_logger("trainer")) as records:
        resumed = Trainer(make_model(), args, train_dataset=make_examples(16))
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))  # mid-epoch
    text = "\n".join(r.getMessage() for r in records)
    assert "save_steps: 3 (from args) != 2 (from trainer_state.json)" in text
    assert "per_device_train_batch_size: 2 (from args) != 4 (from trainer_state.json)" in text
    assert "logging_steps" not in text  # unchanged: not named
