"""Distributed strategies: how a model, its gradients and its data are spread over processes.

One small object per kind, each overriding only what differs (the facade never branches on the kind):

- :class:`DistributedStrategy`: one process, no communication (the null object);
- :class:`ProcessGroupStrategy`: the collectives every multi-process kind shares (gloo on CPU, nccl on CUDA);
- :class:`~mixprec.accelerator.ddp.DDPStrategy`: replicated model, gradients all-reduced in backward;
- :class:`~mixprec.accelerator.fsdp.FSDP2Strategy`: parameters, gradients and optimizer state sharded.

The process group is set up from the launcher's environment (``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT), so a script needs no ``init_process_group`` of its own. Its collectives
wait at most ``timeout`` seconds for a peer (:mod:`mixprec.accelerator.peers`: 5 minutes by default).

Leaving the group (``close``, from ``Accelerator.end_training()`` or at exit) must not leave a backend
thread holding a tensor that Python has let go of. gloo runs each collective on a worker thread of its own,
which drops its reference to the collective's tensors only *after* the caller's ``wait`` has returned. If
the caller has dropped the tensor by then, torch hands the tensor's Python object to that last C++
reference, so the worker thread must take the GIL to free it; when that happens after the interpreter has
begun shutting down, Python ends the thread (``pthread_exit``) in the middle of a C++ destructor and the
process dies with "terminate called without an active exception" (SIGABRT) after its work is done
(seen 3 runs in 30 of a 2-process ``mixprec train`` under torchrun: the rank that finished first, right
after an ``Accelerator.reduce``). So every collective here hands the backend an alias of its tensors
(``detach()``: the same storage, so results land in the caller's tensor) that this object keeps until the
backend has let go of it, and ``close`` waits for that before it destroys the group.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from mixprec.accelerator.peers import PeerLostError, explain, is_collective_failure, launcher_store, timeout_delta
from mixprec.accelerator.prepared import patch_forward
from mixprec.precision.base import default_device

if TYPE_CHECKING:
    from mixprec.accelerator.comm import CommPrecision
    from mixprec.precision.base import Precision

logger = logging.getLogger("mixprec.accelerator")

_REQUIRED = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DRAIN_S = 5.0
"""Seconds ``close`` waits for the backend's threads to let go of the tensors of finished collectives
(they normally do within microseconds; only a collective still stuck in the backend takes longer)."""
KINDS = ("ddp", "fsdp")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process (all defaults: a plain ``python script.py``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> LaunchEnv:
        world = int(environ.get("WORLD_SIZE", "1"))
        if world > 1:
            missing = [name for name in _REQUIRED if name not in environ]
            if missing:
                raise RuntimeError(
                    f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: launch with "
                    "`torchrun --nproc_per_node=N script.py`, which sets them all"
                )
        return cls(
            rank=int(environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world))),
        )


def select_device(device: torch.device | str | None, cpu: bool, env: LaunchEnv) -> torch.device:
    """The device this process trains on: ``cuda:LOCAL_RANK`` when CUDA is there, else the CPU."""
    if cpu:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"Accelerator(cpu=True, device={str(device)!r}): the two conflict; pass one of them")
        return torch.device("cpu")
    if device is None:  # the one default-device rule, and this process's GPU under a launcher
        dev = default_device()
        return torch.device("cuda", env.local_rank) if dev.type == "cuda" else dev
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"Accelerator(device={str(device)!r}): CUDA is not available on this machine; "
                "use device='cpu' (or cpu=True)"
            )
        if dev.index is None:
            dev = torch.device("cuda", env.local_rank)
    return dev


class DistributedStrategy:
    """One process. Collectives are identities, so callers write the same code for one process or many."""

    name: ClassVar[str] = "single"
    saves_partial_gradients: ClassVar[bool] = True
    """Whether ``save_state`` can write mid-accumulation gradient sums (plain local ``.grad`` tensors)."""
    sharded_state: bool = False
    """Whether ``save_state`` writes models and optimizers as per-process shards (FSDP2 only; dcp_state.py)."""

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

    def describe(self) -> str:
        return "1 process"

    # -- model ---------------------------------------------------------------------------------------

    def wrap_model(self, model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
        """Move ``model`` to the device, convert it for ``precision`` and make its forward run under the
        precision's autocast. Returns the same module object (see :func:`patch_forward`)."""
        model = precision.convert_module(model.to(self.device))
        patch_forward(model, precision)
        return model

    def replaced_parameters(self) -> dict[int, torch.nn.Parameter]:
        """``id(old parameter) -> new parameter`` for wrappers that replace parameters (FSDP2), so that
        optimizers built before ``prepare`` can be pointed at the new ones."""
        return {}

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
        _reduce_op(op)
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

    def explain_failure(self, err: BaseException) -> PeerLostError | None:
        """The error naming the rank that did not answer, when ``err`` is a collective's failure (else None)."""
        return None

    def close(self, *, wait_for_peers: bool = False) -> None:
        """Release what this strategy set up (the process group it created). ``wait_for_peers``: first wait
        until every process is done with its collectives (end_training; not at exit after a failure)."""


class ProcessGroupStrategy(DistributedStrategy):
    """The collectives of every multi-process kind, over the default process group.

    Joins the group the launcher's environment describes (gloo on CPU, nccl on CUDA), or uses one the
    script initialised itself. Asked for explicitly with one process (no launcher), it makes a
    one-process group in memory, so single-process runs exercise the same code.
    """

    def __init__(self, env: LaunchEnv, device: torch.device, timeout: float | None = None) -> None:
        super().__init__(env, device)
        self._owns_group = False
        self._handed: list[torch.Tensor] = []  # aliases a backend thread may still hold (see the module doc)
        delta = timeout_delta(timeout)
        self.timeout_s = delta.total_seconds()
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if env.world_size > 1:
                extra: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
                store = launcher_store(delta)  # under torchrun: a fresh namespace for each restart
                extra.update({"store": store} if store is not None else {"init_method": "env://"})
                dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=delta, **extra)
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=delta)
            self._owns_group = True
            # A script that never calls end_training() still leaves the group cleanly (nccl warns otherwise).
            atexit.register(self.close)

    @property
    def num_processes(self) -> int:
        return dist.get_world_size()

    @property
    def process_index(self) -> int:
        return dist.get_rank()

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank

    def describe(self) -> str:
        return f"{self.num_processes} processes ({self.name}, {dist.get_backend()})"

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        reduce_op = _reduce_op(op)
        dist.all_reduce(*self._to_backend(tensor), op=reduce_op)
        if op == "mean":
            tensor /= self.num_processes
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        # Sizes first, so processes may hold different numbers of rows (the last batch of an epoch).
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        size = torch.tensor([tensor.shape[0]], device=tensor.device)
        sizes = [torch.zeros_like(size) for _ in range(self.num_processes)]
        dist.all_gather(self._to_backend(*sizes), *self._to_backend(size))
        counts = [int(s.item()) for s in sizes]
        longest = max(counts)
        if tensor.shape[0] < longest:
            pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = [torch.empty_like(tensor) for _ in counts]
        dist.all_gather(self._to_backend(*parts), *self._to_backend(tensor))
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(*self._to_backend(tensor), src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        # torch's broadcast_object_list, through this strategy's broadcast: its tensors are lent to the backend
        # the safe way (see the module doc), which broadcast_object_list's own are not
        sending = self.process_index == src
        data = pickle.dumps(obj) if sending else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src=src)
        if sending:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload, src=src)
        return obj if sending else pickle.loads(payload.cpu().numpy().tobytes())

    def barrier(self) -> None:
        dist.barrier()

    def all_true(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(*self._to_backend(value), op=dist.ReduceOp.MIN)
        return bool(value.item())

    def found_inf_reducer(self) -> Callable[[torch.Tensor], None] | None:
        # DDP's all-reduced gradients would already agree, but a gradient edited on one process (a hook,
        # clipping of a local copy) would not: one scalar all-reduce per step makes the agreement certain.
        def reduce_max(found_inf: torch.Tensor) -> None:
            dist.all_reduce(*self._to_backend(found_inf), op=dist.ReduceOp.MAX)

        return reduce_max

    def explain_failure(self, err: BaseException) -> PeerLostError | None:
        if not is_collective_failure(err) or self.num_processes < 2:
            return None
        return explain(err, self.process_index, self.num_processes, self.timeout_s)

    def close(self, *, wait_for_peers: bool = False) -> None:
        # In this order: every process done with its collectives; the backend's threads done with this
        # process's tensors (else one may free a tensor's Python object during the interpreter's shutdown:
        # SIGABRT, see the module doc); only then the group destroyed.
        if self._owns_group and dist.is_initialized() and wait_for_peers and dist.get_world_size() > 1:
            with contextlib.suppress(Exception):  # after a failure, a peer may be gone: leave anyway
                dist.barrier()
        self._drain(DRAIN_S)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._owns_group:
            atexit.unregister(self.close)
        self._owns_group = False

    # -- tensors lent to the backend -----------------------------------------------------------------

    def _to_backend(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Aliases of ``tensors`` for one collective (the same storage, so its results land in them), kept
        here until the backend has let go of them: so no backend thread ever frees a tensor's Python
        object (it would need the GIL, which it cannot take once the interpreter is shutting down)."""
        self._release_finished()
        aliases = [tensor.detach() for tensor in tensors]
        self._handed.extend(aliases)
        return aliases

    def _release_finished(self) -> None:
        """Drop the aliases no backend thread holds any more (a use count of 1: only their Python object);
        Python then frees them here, on this thread."""
        if self._handed:
            self._handed = [alias for alias in self._handed if _held_elsewhere(alias)]

    def _drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``, GIL released) until no backend thread holds a tensor lent to it."""
        deadline = time.monotonic() + timeout_s
        self._release_finished()
        while self._handed and time.monotonic() < deadline:
            time.sleep(0.001)
            self._release_finished()
        if self._handed:  # a collective still stuck in the backend: keep its tensors alive (never free them)
            logger.debug("%d tensors still held by a collective after %.0f s", len(self._handed), timeout_s)


def _held_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether anything but ``tensor``'s Python object references its C++ tensor (a backend's work, a view).
    ``Tensor._use_count`` is torch's (2.x); without it, nothing can be known, and nothing is waited for."""
    use_count = getattr(tensor, "_use_count", None)
    return use_count is not None and use_count() > 1


def _reduce_op(op: str) -> Any:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}
    if op not in ops:
        raise ValueError(f"unknown reduction {op!r}; choose one of: {', '.join(ops)}")
    return ops[op]


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
    (None: :data:`~mixprec.accelerator.peers.DEFAULT_TIMEOUT_S`). ``comm``: the dtype gradients travel in
    (None: fp32; one process has no traffic, so it is kept only for the multi-process kinds)."""
    if distributed is not None and distributed not in KINDS:
        raise ValueError(f"Accelerator(distributed={distributed!r}): choose one of: None, {', '.join(KINDS)}")
    several = env.world_size > 1 or (dist.is_initialized() and dist.get_world_size() > 1)
    kind = distributed or ("ddp" if several else None)
    if kind == "ddp":
        from mixprec.accelerator.ddp import DDPStrategy

        return DDPStrategy(env, device, ddp_kwargs=ddp_kwargs, timeout=timeout, comm=comm)
    if kind == "fsdp":
        from mixprec.accelerator.fsdp import FSDP2Strategy

        return FSDP2Strategy(
            env, device, shard=fsdp_shard, sharded_state=fsdp_sharded_state, timeout=timeout, comm=comm
        )
    timeout_delta(timeout)  # one process waits for no one, but a bad value is still an error
    return DistributedStrategy(env, device)


def parameters_of(objects: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """A list from a tensor, a list or a generator of parameters (generators can be read once)."""
    return [objects] if isinstance(objects, torch.Tensor) else list(objects)
