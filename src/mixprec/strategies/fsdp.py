"""FSDP2: parameters, gradients and optimizer state sharded across processes (``fully_shard``).

Mixed precision. ``fully_shard`` gets ``MixedPrecisionPolicy(param_dtype=compute dtype,
reduce_dtype=float32)``: parameters are all-gathered in fp16/bf16 (half the traffic and memory of fp32),
gradients are reduce-scattered in fp32 (in bf16/fp16 with ``comm_dtype``: :mod:`mixprec.strategies.comm`),
and the sharded master weights and optimizer state stay fp32. The forward *also* runs under the precision's
autocast, because the policy alone would run every op in the low precision: autocast keeps softmax, norms,
losses and reductions in fp32, as in the single-process mixed modes (its casts of the matmuls' gathered weights
are no-ops). One difference remains from DDP with autocast: ops that autocast leaves alone (embedding lookups,
residual additions) see fp16/bf16 weights here, fp32 ones there; see the tolerance in the tests.

Loss scaling: each process holds different gradient shards, so the scaler's inf check is all-reduced (MAX)
and every process skips the same steps. ``fully_shard`` replaces parameters by sharded DTensor ones;
``prepare`` points optimizers created before it at the new parameters (their state must still be empty).

Works on CPU with gloo (torch 2.13) as on CUDA with nccl. Checkpoints are full state dicts gathered on the main
process, or with ``fsdp_state_dict_type="sharded"`` each process's shards (:meth:`FSDP2Strategy.save_shards`);
either loads into any number of processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mixprec.checkpoint import CheckpointError
from mixprec.precision.master_weights import needs_master
from mixprec.strategies import dcp_state
from mixprec.strategies.comm import CommPrecision
from mixprec.strategies.distributed_type import DistributedType
from mixprec.strategies.process_group import ProcessGroupStrategy
from mixprec.strategies.strategy import Owned, owned_pairs

if TYPE_CHECKING:
    from mixprec.precision.base import Precision
    from mixprec.strategies.launch_env import LaunchEnv


class FSDP2Strategy(ProcessGroupStrategy):
    """``torch.distributed.fsdp.fully_shard`` over all processes.

    ``shard(module) -> bool`` chooses the submodules sharded as units of their own, before the root. The
    default shards each member of every ``nn.ModuleList`` (the transformer-block convention), so the
    all-gather of one block overlaps the compute of another.
    """

    name = "fsdp"
    # a forward all-gathers into, and frees, memory a full state dict of one process may share: copy at the call
    state_held_until_step = False

    def __init__(
        self,
        env: LaunchEnv,
        device: torch.device,
        shard: Callable[[torch.nn.Module], bool] | None = None,
        timeout: float | None = None,
        sharded_state: bool = False,
        comm: CommPrecision | None = None,
    ) -> None:
        super().__init__(env, device, timeout)
        self.comm = comm if comm is not None else CommPrecision()
        self.shard = shard
        self.sharded_state = sharded_state
        self._replaced: dict[int, torch.nn.Parameter] = {}

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP

    def wrap_model(self, model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = precision.convert_module(model.to(self.device))
        if precision.param_dtype == torch.float32:  # fully_shard replaces the parameters a master would copy
            check_no_low_precision_trainable(model)
        # fully_shard, unlike DDP, does not broadcast: make every process start from the main one's weights.
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        low = precision.compute_dtype if precision.compute_dtype != torch.float32 else None
        reduce = self.comm.fsdp_reduce_dtype(precision.compute_dtype)  # comm_dtype="bf16": reduce-scatter in bf16
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)
        mesh = init_device_mesh(self.device.type, (self.num_processes,))
        # every unit, the root too, frees its gathered parameters after forward (torch's default keeps the root's)
        options = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}
        for sub in self._units(model):
            fully_shard(sub, **options)
        fully_shard(model, **options)
        new = dict(model.named_parameters(remove_duplicate=False))
        self._replaced.update({old: new[name] for old, name in names.items()})
        return model

    def _units(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        if self.shard is not None:
            yield from (m for m in model.modules() if m is not model and self.shard(m))
            return
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                yield from (child for child in module if any(True for _ in child.parameters()))

    def follow_replaced_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._replaced:
            return
        if optimizer.state:
            raise ValueError(
                "prepare(): under FSDP the optimizer must be prepared before its first step (it already has "
                "state for the unsharded parameters)"
            )
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        if not hasattr(model, "set_requires_gradient_sync"):
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    # -- full state dicts, gathered on / broadcast from the main process -----------------------------

    def _options(self, loading: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if loading:
            return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=self._options(loading=False))  # a collective
        return state if self.is_main_process else None

    def load_model_state_dict(self, model: torch.nn.Module, read: Callable[[], dict[str, torch.Tensor]]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        state = read() if self.is_main_process else {}
        set_model_state_dict(model, state, options=self._options(loading=True))

    def optimizer_state_dict(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> Any:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if model is None:
            raise ValueError("save_state under FSDP: an optimizer whose parameters belong to no prepared model")
        state = get_optimizer_state_dict(model, optimizer, options=self._options(loading=False))
        return state if self.is_main_process else None

    def load_optimizer_state_dict(
        self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, read: Callable[[], Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if model is None:
            raise ValueError("load_state under FSDP: an optimizer whose parameters belong to no prepared model")
        state = read() if self.is_main_process else {}
        set_optimizer_state_dict(model, optimizer, state, options=self._options(loading=True))

    # -- what save_state writes besides full state dicts ---------------------------------------------

    def partial_gradients(
        self, models: list[torch.nn.Module], micro_step: int, accumulation_steps: int
    ) -> list[dict[str, torch.Tensor]]:
        if micro_step == 0:
            return []
        # the unsynced sums live unsharded inside FSDP2 during no_sync: there is no local .grad to save
        raise CheckpointError(
            f"save_state inside an accumulation window ({micro_step} of {accumulation_steps} micro-batches "
            f"summed) is not supported under {self.name}: save right after an optimizer step (when "
            "accelerator.sync_gradients is True)"
        )

    def save_shards(self, models: list[torch.nn.Module], optimizers: list[Owned], folder: Path) -> None:
        if self.sharded_state:  # every process writes its shards (DCP gathers any process's error to all)
            dcp_state.save_sharded_state(models, owned_pairs(optimizers, "save_state"), folder)


def check_no_low_precision_trainable(model: torch.nn.Module) -> None:
    """``fully_shard`` replaces the parameters an fp32 master would copy (see
    :mod:`mixprec.precision.master_weights`): refuse a trainable fp16/bf16 parameter by name, with the fix."""
    for name, p in model.named_parameters():
        if needs_master(p):
            raise ValueError(
                f"prepare() under FSDP2: parameter {name!r} is {str(p.dtype).removeprefix('torch.')} and "
                "trainable, and cannot get an fp32 master copy here; cast the trainable parameters to float32 "
                "before prepare (peft: get_peft_model(..., autocast_adapter_dtype=True)), or use "
                "precision='bf16-pure'"
            )
