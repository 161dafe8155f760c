"""DDP: the model replicated on every process, gradients all-reduced (averaged) during backward.

The user's module is not replaced by the ``DistributedDataParallel`` wrapper: DDP wraps a small shim that
calls the module's original forward, and the module's own forward, patched by the Accelerator after
``wrap_model``, calls DDP (:meth:`DDPStrategy.training_forward`). So ``prepare`` returns the user's module,
whose ``state_dict()`` keys carry no ``module.`` prefix, while every training forward still goes through DDP
(which is what arms the gradient all-reduce for the backward that follows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from mixprec.strategies.comm import CommPrecision
from mixprec.strategies.distributed_type import DistributedType
from mixprec.strategies.process_group import ProcessGroupStrategy

if TYPE_CHECKING:
    from mixprec.precision.base import Precision
    from mixprec.strategies.launch_env import LaunchEnv


class _ForwardShim(torch.nn.Module):
    """What DDP wraps: owns the user's module (so DDP sees its parameters) and runs its original forward,
    the one it had when wrapped (the Accelerator replaces ``module.forward`` afterwards)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.inner = module
        self.__dict__["_original_forward"] = module.forward  # a bound method: no submodule, no state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_original_forward"](*args, **kwargs)


class DDPStrategy(ProcessGroupStrategy):
    """``torch.nn.parallel.DistributedDataParallel``; ``ddp_kwargs`` go to its constructor
    (e.g. ``find_unused_parameters=True``); ``comm``: the dtype gradients are all-reduced in
    (:mod:`mixprec.strategies.comm`). Its constructor broadcasts the main process's parameters and
    buffers, so every process starts from the same weights."""

    name = "ddp"

    def __init__(
        self,
        env: LaunchEnv,
        device: torch.device,
        ddp_kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        comm: CommPrecision | None = None,
    ) -> None:
        super().__init__(env, device, timeout)
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.comm = comm if comm is not None else CommPrecision()
        self._wrappers: dict[int, DistributedDataParallel] = {}

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.data_parallel(self.device)

    def wrap_model(self, model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
        model = precision.convert_module(model.to(self.device))
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to train, nothing to sync (a frozen teacher, a metric)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(_ForwardShim(model), device_ids=device_ids, **self.ddp_kwargs)
        self.comm.register(ddp)  # gradients on the wire in bf16/fp16 (a communication hook), or DDP's fp32
        self._wrappers[id(model)] = ddp
        return model

    def training_forward(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return self._wrappers.get(id(model))

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        ddp = self._wrappers.get(id(model))
        return ddp.no_sync() if ddp is not None else contextlib.nullcontext()
