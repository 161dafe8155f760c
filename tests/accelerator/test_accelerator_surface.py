"""The accelerate-facing surface of the Accelerator: ``state``, ``gradient_state``, the accumulation plugin,
``free_memory``, ``prepare(..., None)`` and ``unwrap_model``'s options."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Accelerator, DistributedType, GradientAccumulationPlugin


def test_state_describes_this_process_and_follows_the_precision() -> None:
    acc = Accelerator(mixed_precision="bf16", cpu=True, verbose=False)
    state = acc.state
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.is_main_process and state.is_local_main_process and not state.use_distributed
    assert state.device == torch.device("cpu") and state.distributed_type == DistributedType.NO
    assert state.mixed_precision == "bf16"
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute 'nope'"):
        state.nope  # noqa: B018


def test_the_plugin_sets_accumulation_and_conflicts_with_the_steps_argument() -> None:
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3), verbose=False)
    assert acc.gradient_accumulation_steps == acc.gradient_state.num_steps == 3
    with pytest.raises(ValueError, match="gradient_accumulation_steps.*gradient_accumulation_plugin"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(2))
    with pytest.raises(ValueError, match="num_steps"):
        GradientAccumulationPlugin(num_steps=0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        acc.gradient_accumulation_steps = 0


def _sync_flags(plugin: GradientAccumulationPlugin) -> list[bool]:
    acc = Accelerator(gradient_accumulation_plugin=plugin, verbose=False)
    model = acc.prepare(torch.nn.Linear(2, 1))
    loader = acc.prepare(DataLoader(TensorDataset(torch.randn(5, 2)), batch_size=1))
    flags = []
    for (x,) in loader:
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            flags.append(acc.sync_gradients)
    return flags


def test_sync_with_dataloader_decides_whether_the_last_batch_steps() -> None:
    assert _sync_flags(GradientAccumulationPlugin(num_steps=2)) == [False, True, False, True, True]
    assert _sync_flags(GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)) == [
        False,
        True,
        False,
        True,
        False,
    ]


def test_sync_each_batch_skips_no_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(2, sync_each_batch=True), verbose=False)
    model = acc.prepare(torch.nn.Linear(2, 1))
    calls = []
    monkeypatch.setattr(acc.strategy, "no_sync", lambda m: calls.append(m))
    with acc.accumulate(model):
        assert not acc.sync_gradients
    assert calls == []


def test_free_memory_releases_the_prepared_objects_and_a_model_can_be_prepared_again() -> None:
    acc = Accelerator(mixed_precision="fp16", cpu=True, verbose=False)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    assert acc.prepare_model(model) is model
    kept = model
    weight = weakref.ref(model.weight)
    model, opt = acc.free_memory(model, opt)
    assert (model, opt) == (None, None)
    assert acc.prepare_model(kept) is kept  # prepared here before: registered again, not refused
    acc.clear()
    del kept
    gc.collect()
    assert weight() is None


def test_prepare_passes_none_through_in_place() -> None:
    acc = Accelerator(verbose=False)
    model = torch.nn.Linear(2, 2)
    out = acc.prepare(None, model, None)
    assert out[0] is None and out[1] is model and out[2] is None


def test_unwrap_without_the_fp32_wrapper_runs_the_bare_forward() -> None:
    acc = Accelerator(mixed_precision="bf16", cpu=True, verbose=False)
    model = acc.prepare(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    assert model(x).dtype == torch.float32  # autocast inside, fp32 outputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32  # the wrapper converts the output back
    bare = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert bare is model and "forward" not in vars(bare)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bare(x).dtype == torch.bfloat16  # no conversion any more: the module's own forward
    pickle.loads(pickle.dumps(bare))(x)


def test_unwrap_keeps_or_removes_torch_compile() -> None:
    acc = Accelerator(verbose=False)
    inner = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(inner))
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is inner
    kept = acc.unwrap_model(compiled)
    assert kept is compiled and kept._orig_mod is inner


def test_what_accelerate_launch_sets_is_honoured_unless_the_code_says_otherwise(monkeypatch) -> None:
    # `accelerate launch --mixed_precision fp16 --gradient_accumulation_steps 4 --cpu` hands these over: a script
    # moved from HF Accelerate by its import must not silently train in fp32
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    acc = Accelerator(verbose=False)
    assert acc.mixed_precision == "fp16" and acc.precision.name == "fp16"
    assert acc.gradient_accumulation_steps == 4 and acc.device == torch.device("cpu")
    explicit = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, verbose=False)
    assert explicit.mixed_precision == "bf16" and explicit.gradient_accumulation_steps == 2
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "four")
    with pytest.raises(ValueError, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS='four'"):
        Accelerator(verbose=False)


def test_without_the_launcher_the_default_is_full_precision(monkeypatch) -> None:
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_TORCH_DEVICE", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    assert Accelerator(verbose=False).precision.name == "fp32"


def test_sharded_state_dicts_need_fsdp_and_a_known_name() -> None:
    with pytest.raises(ValueError, match=r"fsdp_state_dict_type='sharded'.*distributed='fsdp'"):
        Accelerator(cpu=True, fsdp_state_dict_type="sharded")
    with pytest.raises(ValueError, match=r"Accelerator\(fsdp_state_dict_type=3\)"):
        Accelerator(cpu=True, distributed="fsdp", fsdp_state_dict_type=3)


# -- PartialState, _reset_state and accelerate's names for the prepared objects -----------------------------


def test_partial_state_describes_this_process_and_runs_the_main_only_helpers() -> None:
    from mixprec import PartialState

    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.device.type) == (1, 0, "cpu")
    assert state.is_main_process and state.is_last_process and not state.use_distributed
    with state.main_process_first(), state.local_main_process_first():
        pass
    assert state.on_main_process(lambda x: x + 1)(1) == 2
    with state.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]


@pytest.mark.parametrize(
    ("count", "padding", "expected"),
    [
        (3, False, [[0, 1, 2], [3, 4], [5, 6]]),  # 7 over 3: the first process gets the extra item
        (3, True, [[0, 1, 2], [3, 4, 4], [5, 6, 6]]),  # padded: equal lengths, the last item repeated
        (4, False, [[0, 1], [2, 3], [4, 5], [6]]),
        (8, True, [[0], [1], [2], [3], [4], [5], [6], [6]]),  # more processes than items
    ],
)
def test_split_between_processes_gives_contiguous_shares(count: int, padding: bool, expected: list) -> None:
    from mixprec.strategies.process_state import split_share

    items = list(range(7))
    assert [split_share(items, i, count, padding) for i in range(count)] == expected
    tensors = [split_share(torch.arange(7), i, count, padding).tolist() for i in range(count)]
    assert tensors == expected
    shares = [split_share({"a": items, "b": tuple(items)}, i, count, padding) for i in range(count)]
    assert [s["a"] for s in shares] == expected and [list(s["b"]) for s in shares] == expected


def test_split_between_processes_refuses_what_it_cannot_split() -> None:
    from mixprec.strategies.process_state import split_share

    with pytest.raises(ValueError, match="same length"):
        split_share({"a": [1, 2], "b": [1]}, 0, 2)
    with pytest.raises(TypeError, match="got set; pass a list, tuple, tensor"):
        split_share({1, 2}, 0, 2)


def test_reset_state_ends_the_view_and_later_reads_say_why() -> None:
    from mixprec import PartialState

    state = PartialState()
    state._reset_state()
    with pytest.raises(AttributeError, match=r"This happens if `PartialState._reset_state\(\)` was called"):
        state.num_processes  # noqa: B018
    acc = Accelerator(verbose=False)
    acc.state.custom = 1  # scripts hang their own values on it
    assert acc.state.custom == 1
    acc.state._reset_state()
    with pytest.raises(AttributeError, match="AcceleratorState._reset_state"):
        acc.num_processes  # noqa: B018


def test_prepared_objects_carry_accelerates_flag_and_lists_until_freed() -> None:
    acc = Accelerator(verbose=False)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    assert model._is_accelerate_prepared and optimizer._is_accelerate_prepared and loader._is_accelerate_prepared
    assert acc._models == [model] and acc._optimizers == [optimizer] and acc._dataloaders == [loader]
    acc.free_memory()
    assert acc._models == [] and acc._optimizers == [] and acc._dataloaders == []
    from mixprec.accelerator.prepared import release

    release(model)  # a model released for another Accelerator is no longer marked prepared
    assert not getattr(model, "_is_accelerate_prepared", False)


def test_process_decorators_trigger_and_save_as_accelerate(tmp_path) -> None:
    acc = Accelerator(cpu=True, verbose=False)
    assert acc.on_main_process(lambda: "main")() == "main" and acc.on_last_process(lambda: "last")() == "last"
    assert acc.on_local_main_process(lambda: "local")() == "local"
    assert acc.on_process(lambda: "one", process_index=1)() is None  # there is no process 1 here
    assert acc.on_process(process_index=0)(lambda: "zero")() == "zero"  # the decorator-factory form
    with pytest.raises(ValueError, match="process_index"):
        acc.on_process(lambda: None)
    assert acc.is_last_process and not acc.use_distributed
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False  # lowered once seen
    weights = {"w": torch.arange(4.0)}
    acc.save(weights, tmp_path / "w.pt")
    acc.save(weights, tmp_path / "w.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], weights["w"])
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], weights["w"])


def test_unscale_gradients_gives_the_true_gradients_once_per_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 4)
    reference(x).pow(2).mean().backward()
    acc = Accelerator(mixed_precision="fp16", cpu=True, verbose=False, scaler_kwargs={"init_scale": 256.0})
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(x).float().pow(2).mean())
    assert model.weight.grad.abs().sum() > 100 * reference.weight.grad.abs().sum()  # still scaled (x256)
    acc.unscale_gradients()
    unscaled = model.weight.grad.clone()
    torch.testing.assert_close(unscaled, reference.weight.grad, rtol=2e-2, atol=1e-3)  # fp16 forward
    acc.unscale_gradients(opt)  # a second call in the same step changes nothing
    assert torch.equal(model.weight.grad, unscaled)
    before = model.weight.detach().clone()
    opt.step()
    torch.testing.assert_close(model.weight.detach(), before - 0.1 * unscaled)  # not unscaled twice


def test_an_accelerator_pickles_while_accelerates_own_state_holds_loaders() -> None:
    # accelerate's GradientState keeps weak references to accelerate's loaders (an HF Trainer run earlier in the
    # process leaves some); the Accelerator mirrors into it, and still pickles, as accelerate's scripts expect.
    state = pytest.importorskip("accelerate.state")
    acc = Accelerator(gradient_accumulation_steps=2, verbose=False)
    theirs = DataLoader(TensorDataset(torch.arange(4)))
    state.GradientState()._add_dataloader(theirs)
    try:
        loaded = pickle.loads(pickle.dumps(acc))
        assert loaded.gradient_accumulation_steps == 2
        loaded.gradient_accumulation_steps = 3  # the copy still mirrors into this process's GradientState
        assert state.GradientState().num_steps == 3
    finally:
        state.GradientState()._remove_dataloader(theirs)
