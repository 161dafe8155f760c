"""HF Accelerate's save_state/load_state contract (its ``tests/test_state_checkpointing.py``, the tests that
run on a CPU, each with safetensors and with torch pickle weights), checked against mixprec's Accelerator or
accelerate's own, chosen by one environment variable:

    PYTHONPATH=src:. pytest -q tests/compat/test_accelerate_state_checkpointing.py
    MIXPREC_COMPAT_IMPL=accelerate PYTHONPATH=src:. pytest -q tests/compat/test_accelerate_state_checkpointing.py

The code is ours, written from reading theirs; each test is named after the upstream test it checks. The
DataLoaders load in the main process (upstream uses 4 workers; the shuffle order, which is what a resume
must reproduce, is drawn in the main process either way).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL not in ("mixprec", "accelerate"):
    raise ValueError(f"MIXPREC_COMPAT_IMPL={IMPL!r}: choose mixprec or accelerate")
if IMPL == "accelerate":
    accelerate = pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
else:  # the one line a user changes
    from mixprec import Accelerator, ProjectConfiguration

FORMATS = pytest.mark.parametrize("use_safetensors", [True, False], ids=["use_safetensors", "use_pytorch"])


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    if IMPL == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def seed_everything(seed=42):
    random.seed(seed)
    torch.manual_seed(seed)


def make_accelerator(**kwargs):
    if IMPL == "mixprec":
        kwargs.setdefault("verbose", False)
    return Accelerator(**kwargs)


class Line(nn.Module):
    """y = a * x + b."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1))
        self.b = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return x * self.a + self.b


def loaders(batch_size=16, n_train=10, n_valid=2):
    def dataset(n):
        x = torch.randn(batch_size * n, 1)
        return TensorDataset(x, 2 * x + 3 + 0.1 * torch.randn(batch_size * n, 1))

    return (
        DataLoader(dataset(n_train), shuffle=True, batch_size=batch_size),
        DataLoader(dataset(n_valid), shuffle=False, batch_size=batch_size),
    )


def train(epochs, model, loader, optimizer, accelerator, scheduler=None):
    """Full epochs; one python random draw after each, which a resume must reproduce too."""
    draws = []
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        draws.append(random.random())
        if scheduler is not None:
            scheduler.step()
    return draws


def fresh_run(**accelerator_kwargs):
    seed_everything()
    model = Line()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dl, valid_dl = loaders()
    accelerator = make_accelerator(**accelerator_kwargs)
    model, optimizer, train_dl, valid_dl = accelerator.prepare(model, optimizer, train_dl, valid_dl)
    return accelerator, model, optimizer, train_dl


def weights(model):
    return model.a.item(), model.b.item()


def same_adam_state(first, second):
    assert first["param_groups"] == second["param_groups"]
    assert first["state"].keys() == second["state"].keys()
    for key, state in first["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(second["state"][key][name])), name


@FORMATS
def test_with_save_limit(tmp_path, use_safetensors):
    config = ProjectConfiguration(total_limit=1, project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator, *_ = fresh_run(project_config=config)
    accelerator.save_state(safe_serialization=use_safetensors)
    accelerator.save_state(safe_serialization=use_safetensors)
    assert len(os.listdir(accelerator.project_dir)) == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1"]


@FORMATS
def test_can_resume_training_with_folder(tmp_path, use_safetensors):
    accelerator, model, optimizer, train_dl = fresh_run()
    initial = str(tmp_path / "initial")
    accelerator.save_state(initial, safe_serialization=use_safetensors)
    start, start_opt = weights(model), optimizer.state_dict()
    truth = train(3, model, train_dl, optimizer, accelerator)
    end, end_opt = weights(model), optimizer.state_dict()

    accelerator, model, optimizer, train_dl = fresh_run()
    accelerator.load_state(initial)
    assert weights(model) == start
    same_adam_state(start_opt, optimizer.state_dict())
    draws = train(2, model, train_dl, optimizer, accelerator)
    checkpoint = str(tmp_path / "checkpoint")
    accelerator.save_state(checkpoint, safe_serialization=use_safetensors)
    accelerator.load_state(checkpoint)
    draws += train(1, model, train_dl, optimizer, accelerator)
    assert weights(model) == end
    same_adam_state(end_opt, optimizer.state_dict())
    assert draws == truth


def _resume_automatic(project_dir, use_safetensors, load_latest):
    naming = {"automatic_checkpoint_naming": True}
    accelerator, model, optimizer, train_dl = fresh_run(
        project_dir=project_dir, project_config=ProjectConfiguration(**naming)
    )
    accelerator.save_state(safe_serialization=use_safetensors)
    start, start_opt = weights(model), optimizer.state_dict()
    truth = train(3, model, train_dl, optimizer, accelerator)
    end, end_opt = weights(model), optimizer.state_dict()

    accelerator, model, optimizer, train_dl = fresh_run(
        project_dir=project_dir, project_config=ProjectConfiguration(iteration=1, **naming)
    )
    if load_latest:
        accelerator.load_state()
    else:
        accelerator.load_state(os.path.join(project_dir, "checkpoints", "checkpoint_0"))
    assert weights(model) == start
    same_adam_state(start_opt, optimizer.state_dict())
    draws = train(2, model, train_dl, optimizer, accelerator)
    accelerator.save_state(safe_serialization=use_safetensors)
    accelerator.load_state(os.path.join(project_dir, "checkpoints", "checkpoint_1"))
    draws += train(1, model, train_dl, optimizer, accelerator)
    assert weights(model) == end
    same_adam_state(end_opt, optimizer.state_dict())
    assert draws == truth


@FORMATS
def test_can_resume_training(tmp_path, use_safetensors):
    _resume_automatic(str(tmp_path), use_safetensors, load_latest=False)


@FORMATS
def test_can_resume_training_checkpoints_relative_path(tmp_path, monkeypatch, use_safetensors):
    monkeypatch.chdir(tmp_path)
    os.mkdir("relative")
    _resume_automatic("relative", use_safetensors, load_latest=True)


@FORMATS
def test_invalid_registration(use_safetensors):
    net = Line()
    accelerator = make_accelerator()
    with pytest.raises(ValueError) as raised:
        accelerator.register_for_checkpointing(
            torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]), net, torch.optim.Adam(net.parameters())
        )
    message = str(raised.value)
    assert "Item at index 0" in message and "Item at index 1" in message
    assert "Item at index 2" not in message and "Item at index 3" not in message


def _with_scheduler(tmp_path, **kwargs):
    seed_everything()
    model = Line()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    train_dl, valid_dl = loaders()
    config = ProjectConfiguration(automatic_checkpoint_naming=True)
    accelerator = make_accelerator(project_dir=str(tmp_path), project_config=config)
    prepared = accelerator.prepare(model, optimizer, train_dl, valid_dl, scheduler)
    return accelerator, prepared


@FORMATS
def test_with_scheduler(tmp_path, use_safetensors):
    accelerator, (model, optimizer, train_dl, _, scheduler) = _with_scheduler(tmp_path)
    accelerator.save_state(safe_serialization=use_safetensors)
    saved = scheduler.state_dict()
    train(3, model, train_dl, optimizer, accelerator, scheduler)
    assert saved != scheduler.state_dict()
    accelerator.load_state(os.path.join(tmp_path, "checkpoints", "checkpoint_0"))
    assert saved == scheduler.state_dict()


@FORMATS
def test_automatic_loading(tmp_path, use_safetensors):
    accelerator, (model, optimizer, train_dl, _, scheduler) = _with_scheduler(tmp_path)
    accelerator.save_state(safe_serialization=use_safetensors)
    train(2, model, train_dl, optimizer, accelerator, scheduler)
    second = weights(model)
    accelerator.save_state(safe_serialization=use_safetensors)
    train(1, model, train_dl, optimizer, accelerator, scheduler)
    third = weights(model)
    accelerator.load_state()  # the newest: the second save
    assert weights(model) == second and weights(model) != third


@FORMATS
def test_checkpoint_deletion(tmp_path, use_safetensors):
    seed_everything()
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    accelerator = make_accelerator(project_dir=str(tmp_path), project_config=config)
    accelerator.prepare(Line())
    for _ in range(11):
        accelerator.save_state(safe_serialization=use_safetensors)
    folder = tmp_path / "checkpoints"
    assert not (folder / "checkpoint_0").exists()
    assert (folder / "checkpoint_9").exists() and (folder / "checkpoint_10").exists()
