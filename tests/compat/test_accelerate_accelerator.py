"""HF Accelerate's Accelerator contract (its ``tests/accelerator/test_accelerator.py``, the tests that run on a CPU),
checked against mixprec's Accelerator or accelerate's own, chosen by one environment variable:

    PYTHONPATH=src:. pytest -q tests/compat/test_accelerate_accelerator.py                            # mixprec
    MIXPREC_COMPAT_IMPL=accelerate PYTHONPATH=src:. pytest -q tests/compat/test_accelerate_accelerator.py  # accelerate

The code is ours, written from reading theirs; each test is named after the upstream test whose contract it
checks (a parameterized upstream test is one test per parameter here, as there). Where the upstream test
reads accelerate's private attributes for something a user can observe (``_models`` emptied by
``free_memory``), the check goes through what the user sees instead (the parameters are freed). Tests that
read only accelerate's internals or HF-specific machinery are expected failures (xfail) under mixprec, each
naming what it reads.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL not in ("mixprec", "accelerate"):
    raise ValueError(f"MIXPREC_COMPAT_IMPL={IMPL!r}: choose mixprec or accelerate")
accelerate = pytest.importorskip("accelerate")  # its checkpoint loader reads what save_model wrote, for both
if IMPL == "accelerate":
    from accelerate import Accelerator
else:  # the one line a user changes
    from mixprec import Accelerator

from accelerate.utils.modeling import load_checkpoint_in_model  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide state; its own test case class resets it after every test."""
    yield
    if IMPL == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def accelerate_internal(what: str):
    return pytest.mark.xfail(IMPL != "accelerate", reason=f"accelerate internal: {what}", strict=True)


def make_accelerator(**kwargs):
    if IMPL == "mixprec":
        kwargs.setdefault("verbose", False)
    return Accelerator(**kwargs)


class TiedPair(torch.nn.Module):
    """2 -> 4 -> 2 with the second layer's weight and bias the first's (tied)."""

    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(2, 4)
        self.linear2 = torch.nn.Linear(4, 2)
        self.linear2.weight = self.linear1.weight
        self.linear2.bias = self.linear1.bias

    def forward(self, x):
        return self.linear2(self.linear1(x))


class ThreeLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 4)
        self.batchnorm = torch.nn.BatchNorm1d(4)
        self.linear2 = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


def components(tied=False):
    model = TiedPair() if tied else torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, steps_per_epoch=2, epochs=1)
    train = DataLoader(TensorDataset(torch.tensor([1.0, 2.0, 3.0])))
    valid = DataLoader(TensorDataset(torch.tensor([4.0, 5.0, 6.0])))
    return model, optimizer, scheduler, train, valid


def signature(model):
    return sum(p.abs().sum().item() for p in model.parameters())


def randomize(model):
    fresh = TiedPair() if isinstance(model, TiedPair) else torch.nn.Linear(model.in_features, model.out_features)
    model.load_state_dict(fresh.state_dict())


# -- state objects -----------------------------------------------------------------------------------------


def test_partial_state_after_reset():
    if IMPL == "accelerate":
        from accelerate.state import PartialState
    else:
        from mixprec import PartialState
    state = PartialState()
    assert state.num_processes > 0
    state._reset_state()
    with pytest.raises(AttributeError, match="_reset_state"):
        state.num_processes  # noqa: B018


def test_accelerator_state_after_reset():
    accelerator = make_accelerator()
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute"):
        accelerator.state.someotherthing  # noqa: B018
    accelerator.state.someotherthing = "MyValue"
    assert accelerator.state.someotherthing == "MyValue"
    accelerator.state._reset_state()
    with pytest.raises(AttributeError, match="_reset_state"):
        accelerator.num_processes  # noqa: B018


def test_mutable_states():
    """The accumulation steps and sync flag set on the Accelerator are what its gradient state reports."""
    accelerator = make_accelerator()
    state = accelerator.gradient_state
    assert state.num_steps == 1
    accelerator.gradient_accumulation_steps = 4
    assert state.num_steps == 4
    assert state.sync_gradients is True
    accelerator.sync_gradients = False
    assert state.sync_gradients is False


def test_prepared_objects_are_referenced():
    accelerator = make_accelerator()
    prepared = accelerator.prepare(*components())
    assert prepared[0] in accelerator._models
    assert prepared[1] in accelerator._optimizers
    assert prepared[2] in accelerator._schedulers
    assert prepared[3] in accelerator._dataloaders and prepared[4] in accelerator._dataloaders


def test_free_memory_dereferences_prepared_components():
    """free_memory returns Nones to assign back, and afterwards the accelerator holds none of the prepared
    objects: once the user drops theirs, the parameters are freed (upstream reads ``_models`` for this)."""
    accelerator = make_accelerator()
    model, optimizer, scheduler, train, valid = accelerator.prepare(*components())
    accelerator.backward(model(torch.randn(3, 2)).sum())
    optimizer.step()
    weight = weakref.ref(model.weight)
    returned = accelerator.free_memory(model, optimizer, scheduler, train, valid)
    assert list(returned) == [None] * 5
    model, optimizer, scheduler, train, valid = returned
    gc.collect()
    assert weight() is None


def test_env_var_device(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:64")
    monkeypatch.setattr(torch.cpu, "set_device", lambda *a, **k: None, raising=False)
    if IMPL == "accelerate":
        from accelerate.state import PartialState

        PartialState._reset_state()
    accelerator = make_accelerator()
    assert str(accelerator.state.device) == "cpu:64"


# -- save_state / load_state -------------------------------------------------------------------------------


def _save_load_model(tmp_path, use_safetensors, tied):
    accelerator = make_accelerator()
    model, optimizer, scheduler, train, valid = components(tied)
    accelerator.prepare(model, optimizer, scheduler, train, valid)  # the same module object, on one process
    before = signature(model)
    accelerator.save_state(str(tmp_path), safe_serialization=use_safetensors)
    randomize(model)
    assert abs(before - signature(model)) > 1e-3
    accelerator.load_state(str(tmp_path))
    assert abs(before - signature(model)) < 1e-3


def test_save_load_model_use_safetensors_tied_weights(tmp_path):
    _save_load_model(tmp_path, True, True)


def test_save_load_model_use_safetensors(tmp_path):
    _save_load_model(tmp_path, True, False)


def test_save_load_model_use_pytorch(tmp_path):
    _save_load_model(tmp_path, False, False)


def _save_load_with_hooks(tmp_path, use_safetensors):
    accelerator = make_accelerator()
    model, optimizer, scheduler, train, valid = components()
    accelerator.prepare(model, optimizer, scheduler, train, valid)
    before = signature(model)

    def save_config(models, weights, output_dir):
        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump({"class_name": type(models[0]).__name__}, f)

    def load_config(models, input_dir):
        with open(os.path.join(input_dir, "data.json")) as f:
            models[0].class_name = json.load(f)["class_name"]

    handles = [
        accelerator.register_save_state_pre_hook(save_config),
        accelerator.register_load_state_pre_hook(load_config),
    ]
    accelerator.save_state(str(tmp_path / "a"), safe_serialization=use_safetensors)
    randomize(model)
    model.class_name = "random"
    accelerator.load_state(str(tmp_path / "a"))
    assert abs(before - signature(model)) < 1e-3
    assert model.class_name == type(model).__name__
    for handle in handles:
        handle.remove()
    accelerator.save_state(str(tmp_path / "b"), safe_serialization=use_safetensors)
    randomize(model)
    model.class_name = "random"
    accelerator.load_state(str(tmp_path / "b"))
    assert abs(before - signature(model)) < 1e-3
    assert model.class_name == "random"  # the removed hooks no longer run


def test_save_load_model_with_hooks_use_safetensors(tmp_path):
    _save_load_with_hooks(tmp_path, True)


def test_save_load_model_with_hooks_use_pytorch(tmp_path):
    _save_load_with_hooks(tmp_path, False)


# -- save_model: the Hugging Face layout, read back by accelerate's loader ---------------------------------


def _save_model(tmp_path, use_safetensors):
    accelerator = make_accelerator()
    model = torch.nn.Linear(10, 10)
    before = signature(model)
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors)
    with torch.no_grad():
        model.weight.zero_()
    load_checkpoint_in_model(model, str(tmp_path))
    assert abs(before - signature(model)) < 1e-3


def test_save_model_use_safetensors(tmp_path):
    _save_model(tmp_path, True)


def test_save_model_use_pytorch(tmp_path):
    _save_model(tmp_path, False)


def _save_sharded(tmp_path, use_safetensors):
    accelerator = make_accelerator()
    inputs = torch.randn(3, 3)
    model = ThreeLayers()
    expected = model(inputs)
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors, max_shard_size=100)
    index = "model.safetensors.index.json" if use_safetensors else "pytorch_model.bin.index.json"
    assert len(set(json.loads((tmp_path / index).read_text())["weight_map"].values())) > 1
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint_in_model(model, str(tmp_path))
    torch.testing.assert_close(model(inputs), expected, atol=1e-5, rtol=0)


def test_save_sharded_model_use_safetensors(tmp_path):
    _save_sharded(tmp_path, True)


def test_save_sharded_model_use_pytorch(tmp_path):
    _save_sharded(tmp_path, False)


def _save_offloaded(tmp_path, use_safetensors):
    from accelerate import load_checkpoint_and_dispatch

    accelerator = make_accelerator()
    inputs = torch.randn(3, 3)
    model = ThreeLayers()
    expected = model(inputs)
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors)
    device_map = {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"}
    load_checkpoint_and_dispatch(model, str(tmp_path), device_map=device_map, offload_folder=str(tmp_path))
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors)
    load_checkpoint_and_dispatch(model, str(tmp_path))
    torch.testing.assert_close(model(inputs), expected, atol=1e-5, rtol=0)


@accelerate_internal("big-model offload hooks (load_checkpoint_and_dispatch with a 'disk' device_map)")
def test_save_model_offload_use_safetensors(tmp_path):
    _save_offloaded(tmp_path, True)


@accelerate_internal("big-model offload hooks (load_checkpoint_and_dispatch with a 'disk' device_map)")
def test_save_model_offload_use_pytorch(tmp_path):
    _save_offloaded(tmp_path, False)


# -- prepare -----------------------------------------------------------------------------------------------


def test_accelerator_none():
    accelerator = make_accelerator()
    *_, dummy = accelerator.prepare(*components(), None)
    assert dummy is None


def test_is_accelerator_prepared():
    accelerator = make_accelerator()
    dummy = [1, 2, 3]
    *prepared, dummy = accelerator.prepare(*components(), dummy)
    assert getattr(dummy, "_is_accelerate_prepared", False) is False
    assert all(getattr(obj, "_is_accelerate_prepared", False) is True for obj in prepared)


def test_prepare_model_twice_does_not_double_wrap(tmp_path):
    """Preparing a prepared model returns it unchanged and registers it once: one model in the saved state
    (upstream counts ``_models``)."""
    accelerator = make_accelerator()
    prepared = accelerator.prepare_model(torch.nn.Linear(10, 2))
    assert accelerator.prepare_model(prepared) is prepared
    accelerator.save_state(str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model_1.safetensors").exists()


def test_prepare_model_8bit_cpu_offload_raises_valueerror_not_typeerror():
    """A model loaded in 8 bits (bitsandbytes) with part of it on the CPU cannot be trained: ValueError."""
    from unittest.mock import patch

    accelerator = make_accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.is_loaded_in_8bit = True
    model.hf_device_map = {"": "cpu"}
    with pytest.raises(ValueError, match="CPU or disk offload"):
        if IMPL == "accelerate":
            with (
                patch("accelerate.accelerator.is_bitsandbytes_multi_backend_available", return_value=False),
                patch("accelerate.accelerator.is_xpu_available", return_value=False),
            ):
                accelerator.prepare_model(model)
        else:
            accelerator.prepare_model(model)


# -- unwrap_model ------------------------------------------------------------------------------------------


def test_can_unwrap_model():
    model = components()[0]
    accelerator = make_accelerator(mixed_precision="no", cpu=True)
    inputs = torch.randn(10, 2)
    model = accelerator.prepare(model)
    model(inputs)
    model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert type(model) is torch.nn.Linear
    model(inputs)
    pickle.loads(pickle.dumps(model))(inputs)


def test_can_unwrap_distributed_compiled_model_keep_torch_compile():
    model = components()[0]
    accelerator = make_accelerator()
    compiled = torch.compile(model)
    unwrapped = accelerator.unwrap_model(torch.compile(torch.nn.DataParallel(model)), keep_torch_compile=True)
    assert compiled._orig_mod is unwrapped._orig_mod


def test_can_unwrap_distributed_compiled_model_remove_torch_compile():
    model = components()[0]
    accelerator = make_accelerator()
    compiled = torch.compile(model)
    unwrapped = accelerator.unwrap_model(torch.compile(torch.nn.DataParallel(model)), keep_torch_compile=False)
    assert compiled._orig_mod is unwrapped


# -- pickling ----------------------------------------------------------------------------------------------


def _pickle_loaders(dispatch_batches):
    if IMPL == "accelerate":
        from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, skip_first_batches
        from accelerate.utils.dataclasses import DataLoaderConfiguration
    else:  # one prepared-loader class (in one process, a dispatching loader is a plain one)
        from mixprec import DataLoaderConfiguration, skip_first_batches
        from mixprec.loaders.data import PreparedDataLoader as DataLoaderShard

        DataLoaderDispatcher = DataLoaderShard  # noqa: N806

    dl = DataLoader(TensorDataset(torch.arange(10)))
    config = DataLoaderConfiguration(dispatch_batches=dispatch_batches, use_stateful_dataloader=False)
    accelerator = Accelerator(dataloader_config=config)
    prepared, _ = accelerator.prepare(dl, skip_first_batches(dl, 2))
    kind = DataLoaderDispatcher if dispatch_batches else DataLoaderShard
    assert isinstance(prepared, kind)
    loaded = pickle.loads(pickle.dumps(accelerator))
    first, skipped = loaded._dataloaders
    assert isinstance(first, kind) and [b for b in first] == [b for b in prepared]
    assert len(skipped) == len(prepared) - 2 and [b for b in skipped] == [b for b in prepared][2:]


def test_can_pickle_dataloader_0():
    _pickle_loaders(True)


def test_can_pickle_dataloader_1():
    _pickle_loaders(False)
