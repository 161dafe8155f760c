"""The collectives every multi-process strategy shares, over the default process group.

The process group is set up from the launcher's environment (``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT), so a script needs no ``init_process_group`` of its own. Its collectives
wait at most ``timeout`` seconds for a peer (:mod:`mixprec.strategies.peers`: 5 minutes by default).

Leaving the group (``close``, from ``Accelerator.end_training()`` or at exit) must not leave a backend thread
holding a tensor that Python has let go of: gloo's worker thread drops its reference to a collective's tensors
only *after* the caller's ``wait`` returned, and when that last reference frees the tensor's Python object
during interpreter shutdown, the thread is ended inside a C++ destructor and the process dies with SIGABRT
("terminate called without an active exception"; 3 runs in 30 of a 2-process ``mixprec train``). So every
collective here hands the backend an alias of its tensors (``detach()``: the same storage) that this object
keeps until the backend has let go of it, and ``close`` waits for that before it destroys the group.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec import tree as pytree
from mixprec.strategies.launch_env import LaunchEnv
from mixprec.strategies.peers import PeerLostError, explain, is_collective_failure, launcher_store, timeout_delta
from mixprec.strategies.strategy import DistributedStrategy, reduce_op

logger = logging.getLogger("mixprec.accelerator")

DRAIN_S = 5.0
"""Seconds ``close`` waits for the backend's threads to let go of the tensors of finished collectives
(they normally do within microseconds; only a collective still stuck in the backend takes longer)."""


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
        dist.all_reduce(*self._to_backend(tensor), op=reduce_op(op))
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

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad tensors (nested) along ``dim`` to the longest any process holds, with ``pad_index`` (at the start
        with ``pad_first``). Collective (one all-reduce per tensor, a host sync each); a tensor with fewer than
        ``dim + 1`` dimensions is returned as it is."""
        if self.num_processes == 1:  # a group of one holds the longest already (no collective)
            return data

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if not -tensor.dim() <= dim < tensor.dim():
                return tensor
            axis = dim % tensor.dim()  # a negative dim counts from the end, as accelerate's
            length = tensor.shape[axis]
            size = torch.tensor([length], dtype=torch.int64, device=self.device)
            longest = int(self.all_reduce(size, "max").item())
            if longest == length:
                return tensor
            shape = [*tensor.shape[:axis], longest, *tensor.shape[axis + 1 :]]
            padded = tensor.new_full(shape, pad_index)
            start = longest - length if pad_first else 0
            padded.narrow(axis, start, length).copy_(tensor)
            return padded

        return pytree.tree_map(lambda x: pad(x) if isinstance(x, torch.Tensor) else x, data)

    def agreement(self) -> Callable[[list[str]], list[str]] | None:
        if self.num_processes == 1:
            return None

        def agree(words: list[str]) -> list[str]:
            # any words travel, not only the modes' names (the race's own "settled" and "stop" too)
            return list(self.broadcast_object(list(words), src=0))

        return agree

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
        # process's tensors (see the module doc); only then the group destroyed.
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
        here until the backend has let go of them (see the module doc)."""
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
