"""The Accelerator's processes part, with accelerate's names: collectives over nested tensors, and a flag any
process can raise. Where this process stands and which process runs a block are the process state's
(:class:`~mixprec.strategies.process_state.AcceleratorState`, ``accelerator.state``), which the Accelerator
delegates to directly.

:class:`Processes` is a part the :class:`~mixprec.accelerator.accelerator.Accelerator` owns and delegates to
(``accelerator.gather(...)`` is ``accelerator._processes.gather(...)``): it holds the process state, the
distributed strategy and the trigger flag, and no method branches on the kind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mixprec import tree as pytree

if TYPE_CHECKING:
    from mixprec.strategies.process_state import AcceleratorState
    from mixprec.strategies.strategy import DistributedStrategy


class Processes:
    """Collectives of an Accelerator (see the module doc)."""

    def __init__(self, state: AcceleratorState, strategy: DistributedStrategy) -> None:
        self.state = state
        self._strategy = strategy
        self._trigger = False  # set_trigger's flag, lowered by check_trigger

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    def gather(self, data: Any) -> Any:
        """Concatenate tensors (nested in dicts/lists) from every process along dim 0; processes may hold
        different numbers of rows. Collective, and a host sync (the row counts)."""
        return _map_tensors(data, self._strategy.all_gather, self._strategy.device)

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """:meth:`gather` for an evaluation's outputs, as accelerate's: data that is not all tensors (text
        predictions, numbers), or any with ``use_gather_object=True``, is gathered as Python objects, each
        process's list joined in process order (alone: returned as it is). The prepared DataLoaders repeat no
        sample, so there is nothing to drop."""
        leaves = pytree.tree_leaves(data)
        if not use_gather_object and leaves and all(isinstance(x, torch.Tensor) for x in leaves):
            return self.gather(data)
        if self.num_processes == 1:
            return data
        parts = [self._strategy.broadcast_object(data, src=rank) for rank in range(self.num_processes)]
        return [x for part in parts for x in part] if all(isinstance(p, (list, tuple)) for p in parts) else parts

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad tensors (nested) along ``dim`` to the longest any process holds, with ``pad_index`` (at the start
        with ``pad_first``), so that they can be gathered: accelerate's, for token-level predictions whose
        sequence lengths differ between processes. Collective (one all-reduce per tensor); a tensor with fewer
        than ``dim + 1`` dimensions is returned as it is, as everything is in one process."""
        return self._strategy.pad_across_processes(data, dim, pad_index, pad_first)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """All-reduce tensors (nested) across processes: "sum", "mean", "max" or "min". Returns new tensors."""
        return _map_tensors(data, lambda t: self._strategy.all_reduce(t.clone(), reduction), self._strategy.device)

    def explain_failure(self, err: BaseException) -> BaseException:
        """``err`` itself, or, when it is a collective that failed because a peer died or stopped answering
        within ``timeout``, a :class:`~mixprec.strategies.peers.PeerLostError` naming that rank (asks the
        launcher's store, up to 5 s). ``except Exception as err: raise accelerator.explain_failure(err)``."""
        return self._strategy.explain_failure(err) or err

    # -- a flag any process can raise (accelerate's trigger: stop every process together) ---------------

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` on every process sees it."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check (then lowered everywhere).
        Collective: every process must call it."""
        raised = not self._strategy.all_true(not self._trigger)
        self._trigger = False
        return raised

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` on the main process only (accelerate's): ``torch.save``, or safetensors for a dict of
        tensors with ``safe_serialization=True``."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in obj.items()}, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)


def _map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x.to(device))  # nccl collectives need device tensors (a no-op on the CPU)
        if isinstance(x, (int, float, bool)):
            return fn(torch.tensor(x, device=device))
        raise TypeError(f"gather/reduce take tensors (or dicts/lists of them), got {type(x).__name__}")

    return pytree.tree_map(leaf, data)
