"""The distributed strategies' seams (strategies/): the registry names every kind, the Accelerator routes a
DDP model's training forward through the wrapper the strategy names, FSDP2 refuses what it cannot save; and
the precision watch attaches to any host that has what it reads (watch/host.py), not only an Accelerator."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec import Accelerator, PrecisionWatch
from mixprec.checkpoint import CheckpointError
from mixprec.precision.registry import make_precision
from mixprec.scaling.scaler import GradScaler
from mixprec.strategies.launch_env import LaunchEnv
from mixprec.strategies.registry import KINDS, make_strategy
from mixprec.strategies.strategy import DistributedStrategy


def test_the_registry_names_every_kind_and_refuses_others_with_the_choices() -> None:
    assert KINDS == ("ddp", "fsdp")
    single = make_strategy(None, LaunchEnv(), torch.device("cpu"))
    assert type(single) is DistributedStrategy and single.describe() == "1 process"
    with pytest.raises(ValueError, match=r"distributed='tp'\): choose one of: None, ddp, fsdp"):
        make_strategy("tp", LaunchEnv(), torch.device("cpu"))


def test_one_process_pads_nothing_and_saves_its_partial_sums() -> None:
    strategy = make_strategy(None, LaunchEnv(), torch.device("cpu"))
    data = {"logits": torch.ones(2, 3)}
    assert strategy.pad_across_processes(data, dim=1) is data
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    assert strategy.partial_gradients([model], 0, 4) == []  # at a step boundary nothing is mid-window
    (grads,) = strategy.partial_gradients([model], 1, 4)
    assert grads["weight"] is model.weight.grad


def test_a_ddp_model_trains_through_the_wrapper_and_stays_the_users_module() -> None:
    acc = Accelerator(cpu=True, distributed="ddp", verbose=False)
    try:
        model = torch.nn.Linear(3, 2)
        prepared = acc.prepare(model)
        assert prepared is model and set(model.state_dict()) == {"weight", "bias"}  # no "module." prefix
        wrapper = acc.strategy.training_forward(model)
        assert isinstance(wrapper, torch.nn.parallel.DistributedDataParallel)
        calls = []
        wrapper.register_forward_pre_hook(lambda module, args: calls.append(len(args)))
        model(torch.ones(4, 3)).sum().backward()  # a training forward goes through DDP (it arms the sync)
        with torch.no_grad():
            model(torch.ones(4, 3))  # evaluation does not
        assert calls == [1] and model.weight.grad is not None
        with model.no_sync():  # as accelerate's DDP-wrapped model has it (its LocalSGD enters it)
            assert not wrapper.require_backward_grad_sync
        assert wrapper.require_backward_grad_sync
    finally:
        acc.end_training()


def test_a_group_the_script_joined_without_rank_is_read_from_torch_distributed() -> None:
    # accelerate's debug_launcher joins through a file rendezvous and sets WORLD_SIZE but no RANK
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = LaunchEnv.from_environ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
        assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="RANK, LOCAL_RANK, MASTER_PORT is not"):  # no group: the launcher's job
        LaunchEnv.from_environ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})


def test_fsdp2_refuses_a_save_inside_an_accumulation_window_and_writes_nothing(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, distributed="fsdp", gradient_accumulation_steps=2, verbose=False)
    try:
        model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        with acc.accumulate(model):
            acc.backward(model(torch.ones(2, 4)).sum())
        with pytest.raises(CheckpointError, match=r"accumulation window \(1 of 2 micro-batches.*under fsdp"):
            acc.save_state(tmp_path / "state")
        assert not (tmp_path / "state").exists()
    finally:
        acc.end_training()


@dataclass
class LoopHost:
    """A hand-written loop's own host: what a watch reads, with no Accelerator."""

    scaler: GradScaler
    device: torch.device = torch.device("cpu")
    precision: Any = field(default_factory=lambda: make_precision("fp16", "cpu"))  # its facts: the range watched
    num_processes: int = 1
    project_dir: str | None = None
    gradient_accumulation_steps: int = 1
    registered: list[Any] = field(default_factory=list)

    def register_for_checkpointing(self, *objects: Any) -> None:
        self.registered.extend(objects)


def test_a_watch_attaches_to_any_host_not_only_an_accelerator() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    host = LoopHost(GradScaler(device="cpu"))
    watch = PrecisionWatch(every=1)
    watch.attach(host, model)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        host.scaler.scale(loss).backward()
        host.scaler.step(optimizer)
        host.scaler.update()
        watch.sync(optimizer)
        optimizer.zero_grad()
    watch.close()
    assert host.registered == [watch]  # its fallback list rides in the host's checkpoints
    assert [s.step for s in watch.samples] == [1, 2, 3]


def test_the_accelerator_builds_a_watch_without_importing_the_watch_at_import_time() -> None:
    # the watch (floor 4) loads only for a run that asks for one: not when the Accelerator is imported, and not
    # through anything the package face fills in at import (no global callback: the Accelerator builds it)
    code = (
        "import sys, mixprec.accelerator.accelerator as a\n"
        "assert not [m for m in sys.modules if m.startswith('mixprec.watch')], 'the Accelerator imported watch/'\n"
        "assert not a.Accelerator(cpu=True, verbose=False).watch\n"
        "assert not [m for m in sys.modules if m.startswith('mixprec.watch')], 'watch/ loaded for a run without one'\n"
        "acc = a.Accelerator(cpu=True, verbose=False, watch=5)\n"
        "print(type(acc.watch).__name__, acc.watch.config.every)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PrecisionWatch", "5"]


def test_a_watch_of_the_users_own_is_passed_in_and_attached_through_the_protocol() -> None:
    # HostedWatch: the Accelerator calls attach(host, model) and watch_optimizer(optimizer), nothing else
    calls = []

    class MyWatch:
        def attach(self, host, model):
            calls.append(("attach", host.precision.name, type(model).__name__))

        def watch_optimizer(self, optimizer):
            calls.append(("optimizer", type(optimizer).__name__))

    mine = MyWatch()
    acc = Accelerator(cpu=True, verbose=False, mixed_precision="bf16", watch=mine)
    model = torch.nn.Linear(4, 4)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.watch is mine
    assert calls == [("attach", "bf16", "Linear"), ("optimizer", "SGD")]
