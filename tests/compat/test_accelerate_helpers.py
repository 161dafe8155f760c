"""accelerate's own helper objects passed to mixprec's Accelerator (issue 22): its ProjectConfiguration,
GradientAccumulationPlugin, DataLoaderConfiguration and kwargs handlers are honoured, or refused by name with
the fix; never silently dropped."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from mixprec import Accelerator

utils = pytest.importorskip("accelerate.utils")


def _fp16_steps(acc: Accelerator, n: int) -> None:
    model = torch.nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(n):
        acc.backward(model(torch.ones(2, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()


def test_project_configuration_names_and_prunes_checkpoints(tmp_path):
    config = utils.ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config, verbose=False)
    acc.prepare(torch.nn.Linear(2, 2))
    for _ in range(3):
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert acc.save_iteration == 3


def test_gradient_accumulation_plugin_and_dataloader_configuration():
    plugin = utils.GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    acc = Accelerator(gradient_accumulation_plugin=plugin, verbose=False)
    assert acc.gradient_accumulation_steps == 3 and acc.gradient_state.sync_with_dataloader is False
    acc = Accelerator(dataloader_config=utils.DataLoaderConfiguration(non_blocking=True), verbose=False)
    assert acc.config.non_blocking is True
    with pytest.raises(ValueError, match=r"split_batches=True\) is not supported: pass the per-process batch"):
        Accelerator(dataloader_config=utils.DataLoaderConfiguration(split_batches=True))


def test_grad_scaler_kwargs_set_the_fp16_scaler():
    handler = utils.GradScalerKwargs(init_scale=1024, growth_interval=3)
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[handler], verbose=False)
    assert acc.scaler.get_scale() == 1024.0 and acc.scaler.get_growth_interval() == 3
    _fp16_steps(acc, 3)  # three clean steps: the scale grows once, by the default factor
    assert acc.scaler.get_scale() == 2048.0


def test_ddp_kwargs_reach_distributed_data_parallel_and_comm_hook_becomes_comm_dtype():
    handler = utils.DistributedDataParallelKwargs(
        bucket_cap_mb=15, find_unused_parameters=True, comm_hook=utils.DDPCommunicationHookType.BF16
    )
    acc = Accelerator(kwargs_handlers=[handler], verbose=False)
    assert acc.config.ddp_kwargs == {"bucket_cap_mb": 15, "find_unused_parameters": True}
    assert acc.config.comm_dtype.name == "bf16"  # parsed into the DDP strategy's CommPrecision
    wrapper = utils.DistributedDataParallelKwargs(comm_wrapper=utils.DDPCommunicationHookType.FP16)
    with pytest.raises(ValueError, match=r"DistributedDataParallelKwargs\(comm_wrapper=.*not supported"):
        Accelerator(kwargs_handlers=[wrapper])


def test_init_process_group_kwargs_timeout_and_refused_backend():
    acc = Accelerator(kwargs_handlers=[utils.InitProcessGroupKwargs(timeout=timedelta(seconds=42))], verbose=False)
    assert acc.config.timeout == 42.0
    with pytest.raises(ValueError, match=r"InitProcessGroupKwargs\(backend='gloo'.*\): mixprec picks the backend"):
        Accelerator(kwargs_handlers=[utils.InitProcessGroupKwargs(backend="gloo")])


def test_autocast_kwargs_per_block_and_refused_for_the_whole_run():
    acc = Accelerator(mixed_precision="bf16", verbose=False)
    a = torch.ones(4, 4)
    with acc.autocast():
        assert (a @ a).dtype == torch.bfloat16
        with acc.autocast(autocast_handler=utils.AutocastKwargs(enabled=False)):
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"AutocastKwargs\(enabled=False\)\]\): a whole run without autocast is"):
        Accelerator(mixed_precision="bf16", kwargs_handlers=[utils.AutocastKwargs(enabled=False)])


def test_fp8_handlers_are_accepted_or_refused_by_name():
    if hasattr(utils, "AORecipeKwargs"):
        Accelerator(kwargs_handlers=[utils.AORecipeKwargs()], verbose=False)  # torchao's default: mixprec's fp8
        with pytest.raises(ValueError, match=r"AORecipeKwargs\(.*pad_inner_dim=False.*mixprec's torchao fp8"):
            Accelerator(kwargs_handlers=[utils.AORecipeKwargs(pad_inner_dim=False)])


def test_profile_kwargs_drive_accelerator_profile_and_write_accelerates_trace(tmp_path):
    """accelerate's by_feature/profiler.py: ProfileKwargs in kwargs_handlers, then ``with accelerator.profile()``;
    the recorded ops and the Chrome trace under output_trace_dir are what the script reads."""
    handler = utils.ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "trace"))
    acc = Accelerator(kwargs_handlers=[handler], verbose=False)
    a = torch.randn(16, 16)
    with acc.profile() as prof:
        (a @ a).sum()
    assert any("mm" in event.key for event in prof.key_averages())
    assert (tmp_path / "trace" / "trace_0.json").stat().st_size > 0
    with acc.profile(utils.ProfileKwargs(activities=["cpu"])) as other:  # a handler per call wins
        a + a
    assert other is not prof and not (tmp_path / "trace" / "trace_1.json").exists()


def test_handlers_that_contradict_arguments_or_are_unknown_are_refused():
    with pytest.raises(ValueError, match="two values for init_scale; pass it once"):
        Accelerator(scaler_kwargs={"init_scale": 8.0}, kwargs_handlers=[utils.GradScalerKwargs(init_scale=16.0)])
    with pytest.raises(TypeError, match=r"kwargs_handlers=\[dict\(...\)\]\): not one of accelerate's handlers"):
        Accelerator(kwargs_handlers=[{"init_scale": 8.0}])
    with pytest.raises(TypeError, match=r"project_config=...\): expected a ProjectConfiguration"):
        Accelerator(project_config={"project_dir": "x"})


def test_distributed_type_is_accelerates_vocabulary():
    # scripts compare accelerator.distributed_type with accelerate's enum; every kind mixprec reports has
    # accelerate's name and value
    from mixprec import DistributedType

    for kind in DistributedType:
        assert kind == utils.DistributedType(kind.value) == kind.value
    acc = Accelerator(verbose=False)
    assert acc.distributed_type == utils.DistributedType.NO and acc.distributed_type is DistributedType.NO
    assert acc.state.distributed_type == "NO" and acc.distributed_type != utils.DistributedType.MULTI_GPU


def test_accelerates_local_sgd_runs_disabled_in_one_process():
    # it refused mixprec's Accelerator ("single" was none of its kinds); with one process it trains unchanged
    from accelerate.local_sgd import LocalSGD

    acc = Accelerator(verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    start = model.weight.detach().clone()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2) as local_sgd:
        assert not local_sgd.enabled
        for _ in range(3):
            acc.backward(model(torch.ones(2, 4)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            local_sgd.step()
    assert not torch.equal(model.weight, start)
