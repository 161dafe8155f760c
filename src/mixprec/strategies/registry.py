"""The strategy registry: a kind's name to its class, apart from the base (which never imports its
subclasses), after Lightning Fabric's ``strategies/registry.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mixprec.strategies.ddp import DDPStrategy
from mixprec.strategies.fsdp import FSDP2Strategy
from mixprec.strategies.peers import timeout_delta
from mixprec.strategies.strategy import DistributedStrategy

if TYPE_CHECKING:
    from mixprec.strategies.comm import CommPrecision
    from mixprec.strategies.launch_env import LaunchEnv

STRATEGIES: dict[str, type[DistributedStrategy]] = {"ddp": DDPStrategy, "fsdp": FSDP2Strategy}
"""The multi-process kinds ``Accelerator(distributed=...)`` names; one process needs no name."""
KINDS = tuple(STRATEGIES)


def make_strategy(
    distributed: str | None,
    env: LaunchEnv,
    device: torch.device,
    *,
    ddp_kwargs: Mapping[str, Any] | None = None,
    fsdp_shard: Callable[[torch.nn.Module], bool] | None = None,
    fsdp_sharded_state: bool = False,
    timeout: float | None = None,
    comm: CommPrecision | None = None,
) -> DistributedStrategy:
    """``None``: DDP when several processes were launched (or a group exists), else one process;
    ``"ddp"`` / ``"fsdp"``: that kind, also with one process. ``timeout``: seconds a collective waits
    (None: :data:`~mixprec.strategies.peers.DEFAULT_TIMEOUT_S`). ``comm``: the dtype gradients travel in
    (None: fp32; one process has no traffic, so it is kept only for the multi-process kinds)."""
    if distributed is not None and distributed not in KINDS:
        raise ValueError(f"Accelerator(distributed={distributed!r}): choose one of: None, {', '.join(KINDS)}")
    several = env.world_size > 1 or (dist.is_initialized() and dist.get_world_size() > 1)
    kind = distributed or ("ddp" if several else None)
    if kind is None:
        timeout_delta(timeout)  # one process waits for no one, but a bad value is still an error
        return DistributedStrategy(env, device)
    if kind == "fsdp":
        return FSDP2Strategy(
            env, device, shard=fsdp_shard, sharded_state=fsdp_sharded_state, timeout=timeout, comm=comm
        )
    return DDPStrategy(env, device, ddp_kwargs=ddp_kwargs, timeout=timeout, comm=comm)
