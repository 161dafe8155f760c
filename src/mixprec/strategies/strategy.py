"""The distributed strategy's base: how a model, its gradients and its data are spread over processes.

One small object per kind, each overriding only what differs (the facade never branches on the kind), after
Lightning Fabric's ``strategies/``:

- :class:`DistributedStrategy` (here): one process, no communication (the null object);
- :class:`~mixprec.strategies.process_group.ProcessGroupStrategy`: the collectives every multi-process kind
  shares (gloo on CPU, nccl on CUDA);
- :class:`~mixprec.strategies.ddp.DDPStrategy`: replicated model, gradients all-reduced in backward;
- :class:`~mixprec.strategies.fsdp.FSDP2Strategy`: parameters, gradients and optimizer state sharded.

:func:`~mixprec.strategies.registry.make_strategy` picks one by name; this base never imports its subclasses.
A strategy never patches the model's forward: the Accelerator does that after :meth:`wrap_model`, routing
training forwards through :meth:`training_forward` (DDP's wrapper), so strategies import nothing from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from mixprec.strategies import dcp_state
from mixprec.strategies.distributed_type import DistributedType

if TYPE_CHECKING:
    from mixprec.precision.base import Precision
    from mixprec.strategies.launch_env import LaunchEnv
    from mixprec.strategies.peers import PeerLostError

Owned = tuple[torch.nn.Module | None, torch.optim.Optimizer]
"""An optimizer with the prepared model its parameters belong to (None: no prepared model holds them)."""


class DistributedStrategy:
    """One process. Collectives are identities, so callers write the same code for one process or many."""

    name: ClassVar[str] = "single"
    sharded_state: bool = False
    """Whether ``save_state`` writes models and optimizers as per-process shards (FSDP2 only; dcp_state.py)."""
    state_held_until_step: ClassVar[bool] = True
    """Whether the tensors of :meth:`model_state_dict` / :meth:`optimizer_state_dict` keep their values (and
    their memory) through a forward and backward, so that an asynchronous save may copy them after it returns,
    before the next optimizer step (the model's buffers apart: the save copies those at once)."""

    def __init__(self, env: LaunchEnv, device: torch.device) -> None:
        self.env = env
        self.device = device

    # -- topology ------------------------------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return 1

    @property
    def process_index(self) -> int:
        return 0

    @property
    def local_process_index(self) -> int:
        return 0

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def distributed_type(self) -> DistributedType:
        """The kind in accelerate's vocabulary (``accelerator.distributed_type``); mixprec's own is ``name``."""
        return DistributedType.NO

    def describe(self) -> str:
        return "1 process"

    # -- model ---------------------------------------------------------------------------------------

    def wrap_model(self, model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
        """Move ``model`` to the device and convert it for ``precision``. Returns the same module object; the
        caller then makes its forward run under the precision's autocast (and through
        :meth:`training_forward`)."""
        return precision.convert_module(model.to(self.device))

    def training_forward(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The module a training forward of ``model`` must go through to arm the gradient sync of the backward
        that follows (DDP's wrapper), or None when ``model``'s own forward does (every other kind)."""
        return None

    def follow_replaced_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer``, built before ``prepare``, at the parameters this strategy put in place of the
        model's (FSDP2's sharded ones); nothing to do where the parameters stay the user's."""

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for a micro-batch whose gradients are only accumulated locally (no communication)."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip in place; return the total norm before clipping as a plain tensor (no host sync)."""
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def grad_norm(self, parameters: list[torch.nn.Parameter], norm_type: float) -> torch.Tensor:
        """Total gradient norm without clipping (no host sync)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # -- collectives (identities here) ---------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        reduce_op(op)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every process's ``tensor`` along dim 0 (0-dim tensors become shape ``[N]``)."""
        return tensor.reshape(1) if tensor.dim() == 0 else tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Process ``src``'s ``obj`` on every process (pickled; only between processes of one job)."""
        return obj

    def barrier(self) -> None:
        """Wait until every process reaches this point."""

    def all_true(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on every process (one small collective)."""
        return flag

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Tensors (nested) padded along ``dim`` to the longest any process holds; one process holds them all,
        so ``data`` itself here (see :class:`~mixprec.strategies.process_group.ProcessGroupStrategy`)."""
        return data

    def agreement(self) -> Callable[[list[str]], list[str]] | None:
        """A function handing every process the main one's list of words ("auto" races in lockstep and decides
        once: which modes race on, whether a warm-up has settled, whether to stop); None with one process,
        which decides alone."""
        return None

    def found_inf_reducer(self) -> Callable[[torch.Tensor], None] | None:
        """The scaler's inf-check reduction across processes (None: one process decides alone)."""
        return None

    # -- checkpoint state ----------------------------------------------------------------------------

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The user's module's full state dict on the main process, None elsewhere (a collective for FSDP)."""
        return model.state_dict() if self.is_main_process else None

    def load_model_state_dict(self, model: torch.nn.Module, read: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Load a full state dict; ``read`` reads the file (called on the processes that need it)."""
        model.load_state_dict(read())

    def optimizer_state_dict(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer.state_dict() if self.is_main_process else None

    def load_optimizer_state_dict(
        self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, read: Callable[[], Any]
    ) -> None:
        optimizer.load_state_dict(read())

    def partial_gradients(
        self, models: list[torch.nn.Module], micro_step: int, accumulation_steps: int
    ) -> list[dict[str, torch.Tensor]]:
        """Each model's gradient sums of an unfinished accumulation window (``micro_step`` of
        ``accumulation_steps`` micro-batches summed, not yet synced), which ``save_state`` writes per process so
        a resume continues the window; none at a step boundary (``micro_step == 0``). No copies, no host sync."""
        if micro_step == 0:
            return []
        return [{name: p.grad for name, p in m.named_parameters() if p.grad is not None} for m in models]

    def save_shards(self, models: list[torch.nn.Module], optimizers: list[Owned], folder: Path) -> None:
        """Write the models' and optimizers' state as this process's shards under ``folder`` (DCP; collective),
        when this strategy saves that way (:attr:`sharded_state`); otherwise nothing: the main process writes
        the full state dicts (:meth:`model_state_dict`, :meth:`optimizer_state_dict`)."""

    def load_shards(self, models: list[torch.nn.Module], optimizers: list[Owned], folder: Path) -> None:
        """Read a sharded state (written by :meth:`save_shards` under any number of processes) into ``models``
        and ``optimizers``, each process reading the pieces its own part covers (a plain module: all of them).
        Collective when a process group is running."""
        dcp_state.load_sharded_state(models, owned_pairs(optimizers, "load_state"), folder)

    def explain_failure(self, err: BaseException) -> PeerLostError | None:
        """The error naming the rank that did not answer, when ``err`` is a collective's failure (else None)."""
        return None

    def close(self, *, wait_for_peers: bool = False) -> None:
        """Release what this strategy set up (the process group it created). ``wait_for_peers``: first wait
        until every process is done with its collectives (end_training; not at exit after a failure)."""


def owned_pairs(optimizers: list[Owned], call: str) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """DCP reads and writes an optimizer's state through the model holding its parameters."""
    if any(owner is None for owner, _ in optimizers):
        raise ValueError(f"a sharded {call} needs every optimizer's parameters in one prepared model")
    return [(owner, optimizer) for owner, optimizer in optimizers if owner is not None]


def reduce_op(op: str) -> Any:
    """torch's reduction for ``op`` ("sum", "mean": a sum then divided, "max", "min")."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}
    if op not in ops:
        raise ValueError(f"unknown reduction {op!r}; choose one of: {', '.join(ops)}")
    return ops[op]
