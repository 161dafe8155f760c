"""Where this process runs: ``PartialState`` (no model, no precision: the distributed-inference and
"main process first" helpers, as HF Accelerate's) and ``accelerator.state`` (``AcceleratorState``: the same
plus the precision).

``PartialState()`` reads the launcher's environment and joins the process group when ``torchrun`` started
several processes, as the Accelerator does (an Accelerator made afterwards uses the same group). Unlike
accelerate's, these are not process-wide singletons: each object is a view over one distributed strategy.
``_reset_state()`` is kept for scripts and test suites written for accelerate: it ends the view, and any later
read raises an AttributeError saying so.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from mixprec.strategies.distributed_type import DistributedType
from mixprec.strategies.launch_env import LaunchEnv, select_device
from mixprec.strategies.registry import make_strategy

if TYPE_CHECKING:
    from mixprec.precision.base import Precision
    from mixprec.strategies.strategy import DistributedStrategy

F = TypeVar("F", bound=Callable[..., Any])


class PartialState:
    """The process's place in the run: index, count, device, and the helpers that depend only on those.

    ``cpu=True`` keeps the process on the CPU where a GPU exists; ``timeout``: seconds a collective waits.
    """

    def __init__(self, cpu: bool = False, *, device: torch.device | str | None = None, timeout: float | None = None):
        env = LaunchEnv.from_environ()
        self._strategy: DistributedStrategy = make_strategy(None, env, select_device(device, cpu, env), timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes that do not exist, including every property after _reset_state().
        if name != "_strategy" and "_strategy" not in self.__dict__:
            cls = type(self).__name__  # accelerate's wording, which its test suite and scripts match
            raise AttributeError(
                f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was called and "
                "an `Accelerator` or `PartialState` was not reinitialized."
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _reset_state(self) -> None:
        """End this view (accelerate's test-suite hook): later reads raise AttributeError naming this call.
        The process group is left as it is."""
        self.__dict__.pop("_strategy", None)

    # -- topology ------------------------------------------------------------------------------------

    @property
    def distributed_type(self) -> DistributedType:
        """The kind of run in accelerate's vocabulary (``DistributedType.NO``, ``MULTI_CPU``, ``MULTI_GPU``,
        ``FSDP``, ...): equal to accelerate's own ``DistributedType`` members, so scripts and accelerate's helpers
        that compare with them work."""
        return self._strategy.distributed_type

    @property
    def num_processes(self) -> int:
        """How many processes train together (torchrun's WORLD_SIZE; 1 alone)."""
        return self._strategy.num_processes

    @property
    def process_index(self) -> int:
        """This process's index among all of them (torchrun's RANK; 0 alone)."""
        return self._strategy.process_index

    @property
    def local_process_index(self) -> int:
        """This process's index on its machine (torchrun's LOCAL_RANK; 0 alone)."""
        return self._strategy.local_process_index

    @property
    def is_main_process(self) -> bool:
        """Whether this is the main process (rank 0): the one that logs and writes shared files."""
        return self._strategy.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is the first process on its machine (local rank 0)."""
        return self._strategy.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the process with the highest index."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process trains."""
        return self.num_processes > 1

    @property
    def device(self) -> torch.device:
        """The device this process computes on (cuda:LOCAL_RANK on a GPU machine, else the CPU)."""
        return self._strategy.device

    # -- helpers -------------------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (a barrier; returns at once alone)."""
        self._strategy.barrier()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The main process runs the block first (downloads, caches), then the others."""
        return self._first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The first process of each machine runs the block first, then the others."""
        return self._first(self.is_local_main_process)

    @contextlib.contextmanager
    def _first(self, leads: bool) -> Iterator[None]:
        if not leads:
            self.wait_for_everyone()
        yield
        if leads:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (None elsewhere)."""
        return self._only_where(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on each machine's first process only (None elsewhere)."""
        return self._only_where(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: F) -> F:
        """Decorator: run ``function`` on the last process only (None elsewhere)."""
        return self._only_where(function, lambda: self.is_last_process)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only (``@state.on_process(process_index=1)``
        or ``state.on_process(f, process_index=1)``, as accelerate)."""
        if process_index is None:
            raise ValueError("on_process(...): pass process_index=<the process that runs the function>")
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_where(function, lambda: self.process_index == process_index)

    @staticmethod
    def _only_where(function: F, runs_here: Callable[[], bool]) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if runs_here() else None

        return wrapper  # type: ignore[return-value]

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of ``inputs`` (a list, tuple, tensor, or a dict of those, split
        along the first dimension; the first processes get one more when it does not divide). With
        ``apply_padding``, every share has the same length, the short ones repeating their last element,
        so results can be gathered."""
        yield split_share(inputs, self.process_index, self.num_processes, apply_padding)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(distributed_type={self.distributed_type.value!r}, "
            f"num_processes={self.num_processes}, process_index={self.process_index}, device={str(self.device)!r})"
        )


class AcceleratorState(PartialState):
    """``accelerator.state``: the process's place in the run and its precision. Every attribute is read
    live, so ``mixed_precision`` follows precision="auto" once it has decided."""

    def __init__(self, strategy: DistributedStrategy, precision: Precision) -> None:
        self._strategy = strategy
        self._precision = precision

    def _reset_state(self) -> None:
        super()._reset_state()
        self.__dict__.pop("_precision", None)

    @property
    def mixed_precision(self) -> str:
        """The precision's name ("auto" until it decides, then the chosen mode's), as accelerate's."""
        return self._precision.name

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, mixed_precision={self.mixed_precision!r})"


def split_share(inputs: Any, index: int, count: int, apply_padding: bool = False) -> Any:
    """Process ``index`` of ``count``'s contiguous share of ``inputs`` (see ``split_between_processes``)."""
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes(inputs=dict): every value must have the same length to be split "
                f"alike; got lengths {sorted(lengths)}"
            )
        return {k: split_share(v, index, count, apply_padding) for k, v in inputs.items()}
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise TypeError(
            f"split_between_processes(inputs=...): got {type(inputs).__name__}; pass a list, tuple, tensor or "
            "a dict of those"
        )
    start, end = share_bounds(len(inputs), index, count)
    share = inputs[start:end]
    longest = -(-len(inputs) // count)  # the first share's size
    if apply_padding and len(share) < longest and len(inputs) > 0:
        last = inputs[-1:] if len(share) == 0 else share[-1:]
        missing = longest - len(share)
        if isinstance(share, torch.Tensor):
            share = torch.cat([share, last.expand(missing, *last.shape[1:])])
        else:
            share = share + type(share)(last) * missing
    return share


def share_bounds(n: int, index: int, count: int) -> tuple[int, int]:
    """``(start, end)`` of process ``index``'s contiguous share of ``n`` items among ``count`` processes: sizes
    differ by at most one, the first ``n % count`` processes taking one more. The one split rule of mixprec's
    data (a global step's samples here, ``split_between_processes`` and dispatched batches)."""
    per, extra = divmod(n, count)
    start = index * per + min(index, extra)
    return start, start + per + (1 if index < extra else 0)
