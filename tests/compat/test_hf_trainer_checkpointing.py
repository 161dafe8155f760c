"""transformers' checkpoint/resume contract (read from its tests/trainer/test_trainer_checkpointing.py; our own
code), checked against mixprec's Trainer or HF's:

    PYTHONPATH=src:. pytest -q tests/compat/test_hf_trainer_checkpointing.py                           # mixprec
    MIXPREC_COMPAT_IMPL=transformers PYTHONPATH=src:. pytest -q tests/compat/test_hf_trainer_checkpointing.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL == "transformers":
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainerState, TrainingArguments
else:
    from mixprec import Trainer, TrainerState, TrainingArguments

# mixprec's checkpoint folders hold model.safetensors too; the names below are the ones both libraries write
STATE_FILE, WEIGHTS = "trainer_state.json", "model.safetensors"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


class RegressionDataset(torch.utils.data.Dataset):
    def __init__(self, length=64, seed=42):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=g)
        self.y = 2.0 * self.x + 3.0 + 0.1 * torch.randn(length, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModel(torch.nn.Module):
    def __init__(self, a=0.0, b=0.0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(float(a)))
        self.b = torch.nn.Parameter(torch.tensor(float(b)))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


def trainer_for(tmp_path, train_len=64, eval=False, **kwargs):
    extra = {"save_plots": False} if IMPL == "mixprec" else {}
    args = TrainingArguments(str(tmp_path), report_to="none", disable_tqdm=True, **extra, **kwargs)
    return Trainer(
        RegressionModel(),
        args,
        train_dataset=RegressionDataset(train_len),
        eval_dataset=RegressionDataset(32, seed=1) if eval else None,
    )


def checkpoints(folder) -> list[str]:
    return sorted((p.name for p in Path(folder).glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def comparable(state) -> dict:
    """A TrainerState without what differs between runs by design (timings, the best checkpoint's path)."""
    values = state.to_dict() if hasattr(state, "to_dict") else dict(vars(state))
    # HF's check_trainer_state_are_the_same drops these too: a resumed run's train_loss covers its own steps only
    dropped = ("train_loss", "total_flos")
    history = [
        {k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k and k not in dropped}
        for e in values["log_history"]
    ]
    return {"global_step": values["global_step"], "epoch": values["epoch"], "log_history": history}


def test_save_checkpoints_every_save_steps_and_at_the_end(tmp_path):
    trainer_for(tmp_path, save_steps=5).train()  # 3 epochs x 8 batches = 24 steps
    assert checkpoints(tmp_path) == ["checkpoint-5", "checkpoint-10", "checkpoint-15", "checkpoint-20", "checkpoint-24"]
    for name in checkpoints(tmp_path):
        # HF's check_saved_checkpoints list (trainer_test_utils.py); each .bin/.pt loads with weights_only
        for file in (WEIGHTS, "training_args.bin", "optimizer.pt", "scheduler.pt", STATE_FILE):
            assert (tmp_path / name / file).is_file(), f"{name}/{file}"
        for file in ("optimizer.pt", "scheduler.pt"):  # HF's rng_state.pth needs its safe_globals (numpy)
            torch.load(tmp_path / name / file, weights_only=True)
        assert (tmp_path / name / "rng_state.pth").is_file()
        state = json.loads((tmp_path / name / STATE_FILE).read_text())
        assert state["global_step"] == int(name.split("-")[1])


@pytest.mark.parametrize("checkpoint", ["checkpoint-5", "checkpoint-15"], ids=["within-epoch-1", "over-an-epoch"])
def test_can_resume_training(tmp_path, checkpoint):
    kwargs = {"train_len": 128, "save_steps": 5, "learning_rate": 0.1, "logging_steps": 5}
    trainer = trainer_for(tmp_path, **kwargs)
    trainer.train()
    a, b, state = trainer.model.a.item(), trainer.model.b.item(), comparable(trainer.state)
    resumed = trainer_for(tmp_path, **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / checkpoint))
    assert (resumed.model.a.item(), resumed.model.b.item()) == (a, b)
    assert comparable(resumed.state) == state


def test_resume_from_a_missing_folder_fails(tmp_path):
    trainer = trainer_for(tmp_path)
    with pytest.raises(Exception, match="Can't find a valid checkpoint at"):  # HF's test matches these words
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5-bogus"))


def test_resume_true_without_any_checkpoint_fails(tmp_path):
    trainer = trainer_for(tmp_path)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)


def test_resume_true_takes_the_latest_checkpoint(tmp_path):
    trainer_for(tmp_path, max_steps=10, save_steps=5).train()
    trainer = trainer_for(tmp_path, max_steps=12, save_steps=5)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 12 and trainer.state.log_history  # 10 -> 12


@pytest.mark.xfail(
    IMPL == "transformers",
    reason="transformers (5.24 and 5.25) keeps the checkpoint's train_batch_size on resume (its issue 43708)",
    strict=True,
)
def test_resume_with_a_different_batch_size_uses_the_new_one(tmp_path):
    trainer_for(tmp_path, max_steps=2, save_steps=1, per_device_train_batch_size=2).train()
    saved = TrainerState.load_from_json(str(tmp_path / "checkpoint-1" / STATE_FILE))
    assert saved.train_batch_size == 2
    trainer = trainer_for(tmp_path, max_steps=4, save_steps=1, per_device_train_batch_size=4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.train_batch_size == 4
    assert TrainerState.load_from_json(str(tmp_path / "checkpoint-4" / STATE_FILE)).train_batch_size == 4


def test_resume_with_gradient_accumulation(tmp_path):
    kwargs = {
        "train_len": 128,
        "save_steps": 5,
        "learning_rate": 0.1,
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
    }
    trainer = trainer_for(tmp_path, **kwargs)
    trainer.train()
    a, b = trainer.model.a.item(), trainer.model.b.item()
    resumed = trainer_for(tmp_path, **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert (resumed.model.a.item(), resumed.model.b.item()) == (a, b)


def test_save_total_limit_keeps_the_latest(tmp_path):
    trainer_for(tmp_path, save_steps=5, save_total_limit=2).train()
    assert checkpoints(tmp_path) == ["checkpoint-20", "checkpoint-24"]


def test_save_total_limit_keeps_the_best_too(tmp_path):
    trainer = trainer_for(
        tmp_path,
        eval=True,
        save_steps=5,
        eval_strategy="steps",
        eval_steps=5,
        load_best_model_at_end=True,
        save_total_limit=1,
        learning_rate=0.1,
    )
    trainer.train()
    kept = checkpoints(tmp_path)
    best = Path(trainer.state.best_model_checkpoint).name
    assert best in kept and kept[-1] == "checkpoint-24" and len(kept) <= 2


def test_load_best_model_at_end_restores_the_best_weights(tmp_path):
    trainer = trainer_for(
        tmp_path,
        eval=True,
        save_steps=5,
        eval_strategy="steps",
        eval_steps=5,
        load_best_model_at_end=True,
        learning_rate=0.1,
    )
    trainer.train()
    assert trainer.state.best_metric == min(e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e)
    from safetensors.torch import load_file

    best = load_file(str(Path(trainer.state.best_model_checkpoint) / WEIGHTS))
    for name in ("a", "b"):
        assert torch.equal(best[name], getattr(trainer.model, name).detach().cpu())


def test_the_state_file_is_hfs(tmp_path):
    trainer_for(tmp_path, max_steps=3, save_steps=3, logging_steps=1).train()
    state = TrainerState.load_from_json(str(tmp_path / "checkpoint-3" / STATE_FILE))
    assert state.global_step == 3 and state.max_steps == 3
    assert [e["step"] for e in state.log_history if "loss" in e] == [1, 2, 3]


@pytest.mark.parametrize("eval_every_step", [False, True], ids=["save-at-eval", "save-every-step"])
def test_planted_evaluate_metrics_choose_the_best_checkpoint(tmp_path, eval_every_step):
    # HF's test_best_model_checkpoint_behavior: Trainer._evaluate patched to plant the metrics
    from unittest.mock import patch

    save = {"save_strategy": "steps", "save_steps": 1} if eval_every_step else {"save_strategy": "epoch"}
    trainer = trainer_for(
        tmp_path, eval=True, eval_strategy="epoch", metric_for_best_model="accuracy", greater_is_better=True, **save
    )
    planted = [{"eval_accuracy": 0.59}, {"eval_accuracy": 0.57}, {"eval_accuracy": 0.55}]
    with patch.object(trainer, "_evaluate", side_effect=planted):
        trainer.train()
    assert trainer.state.best_metric == 0.59 and trainer.state.best_global_step == 8  # the first epoch's end
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-8")
