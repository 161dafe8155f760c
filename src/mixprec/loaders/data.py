"""The prepared DataLoader: batches on the right device, the data split across processes, epochs counted.

``prepare`` rebuilds a DataLoader whose sampler is torch's ``SequentialSampler`` or ``RandomSampler``
(``shuffle=False/True``) over a :class:`~mixprec.loaders.sharding.ShardedBatchSampler`: the same
dataset, batch size, collate_fn, workers and ``drop_last``, with each sample seen exactly once per epoch
across all processes. The shuffle seed is drawn once from the loader's generator (or torch's global RNG, so
``torch.manual_seed`` governs it) on the main process and shared, and each epoch's order depends on
``(seed, epoch)`` only. Iterating the prepared loader again starts the next epoch (``set_epoch`` is
automatic); its position (epoch, batches handed out) is saved by ``save_state`` and resumed by ``load_state``.

A loader whose sampler is already split (``DistributedSampler``, or any sampler with ``num_replicas``, such
as the Trainer's) is kept as it is (``set_epoch`` is called for torch's ``DistributedSampler``; other
samplers' epochs and positions belong to their owner). Custom samplers and iterable datasets are kept as
they are in one process; in several, an iterable dataset's batches are read by the main process and sent to
each process (:mod:`mixprec.loaders.dispatch`, also for any loader with ``dispatch_batches=True``), and a
custom sampler without ``dispatch_batches=True`` is refused: it cannot be split without knowing its order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from mixprec.loaders.dispatch import DispatchingLoader
from mixprec.loaders.sharding import ShardedBatchSampler, epoch_seed
from mixprec.tree import tree_map

if TYPE_CHECKING:
    from mixprec.strategies.strategy import DistributedStrategy


class Accumulation(Protocol):
    """What a prepared loader tells the accumulation schedule (the Accelerator's
    :class:`~mixprec.accelerator.gradients.GradientState`): that its epoch's last batch is being trained on,
    so the window ends there and the optimizer steps."""

    end_of_dataloader: bool


def send_to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move tensors in nested dicts, lists, tuples and namedtuples (any container torch's pytree knows, HF
    ModelOutput included), and other objects with ``.to``, to ``device``. Asynchronous for pinned host
    memory with ``non_blocking=True``; no host sync."""

    def moves_itself(node: Any) -> bool:  # an HF BatchEncoding, say: its own .to, not a walk into it
        return not isinstance(node, torch.Tensor) and callable(getattr(node, "to", None))

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(device, non_blocking=non_blocking)
        return leaf.to(device) if moves_itself(leaf) else leaf

    return tree_map(move, data, is_leaf=moves_itself)


class PreparedDataLoader:
    """Iterates like the user's DataLoader; see the module docstring. Other attributes are the loader's."""

    _is_accelerate_prepared = True

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        gradients: Accumulation,
        batch_sampler: ShardedBatchSampler | None = None,
        non_blocking: bool = False,
    ) -> None:
        self.base_loader = loader
        self.device = device
        self.batch_sampler = batch_sampler
        self._gradients = gradients
        self._non_blocking = non_blocking
        self._loader = loader if batch_sampler is None else _rebuild(loader, batch_sampler)
        self._move = device.type != "cpu"  # host batches are already on the host
        self.epoch = 0
        self._yielded = 0
        self._started = False
        self._finished = False
        self._resume: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self._loader)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (normally automatic)."""
        self._resume = (int(epoch), 0)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._resume or (self._next_epoch(), 0)
        self._resume = None
        yield from self._iterate(epoch, start)

    def _next_epoch(self) -> int:
        """The epoch the next iteration runs (a loaded or set one, else the one after the last started)."""
        if self._resume is not None:
            return self._resume[0]
        return self.epoch + 1 if self._started else self.epoch

    def skip_first_batches(self, num_batches: int) -> SkippedDataLoader:
        """This loader, its next epoch starting at batch ``num_batches`` (counted from the epoch's start, so
        after ``load_state`` has put it mid-epoch, skipping the same number again skips nothing twice)."""
        return SkippedDataLoader(self, num_batches)

    def _iterate(self, epoch: int, start: int) -> Iterator[Any]:
        self.epoch, self._yielded, self._started, self._finished = epoch, start, True, False
        if self.batch_sampler is not None:
            self.batch_sampler.set_epoch(epoch, start)
            # iter(DataLoader) draws a worker base seed from its generator (else from the global RNG, which
            # would shift a resumed run's dropout masks): a private one, reseeded per epoch.
            self._loader.generator.manual_seed(epoch_seed(self.batch_sampler.seed, epoch) + 1)
        elif isinstance(self._loader.sampler, DistributedSampler):
            self._loader.sampler.set_epoch(epoch)
        dataset = self._loader.dataset
        if callable(getattr(dataset, "set_epoch", None)):  # a stream that reshuffles per pass, as accelerate's
            dataset.set_epoch(epoch)
        self._gradients.end_of_dataloader = False
        # One batch of look-ahead, so the last batch is known as such when it is handed out: accumulate()
        # then syncs and steps on it even when the epoch is not a multiple of the accumulation steps.
        batches = iter(self._loader)
        if callable(getattr(dataset, "pass_begun", None)):  # a resume's skip: this pass's (loaders/from_datasets)
            dataset.pass_begun()
        if self.batch_sampler is None:  # a kept loader: its batches are read, and dropped, to get there
            for _ in range(start):
                next(batches, None)
        current = next(batches, _END)
        while current is not _END:
            upcoming = next(batches, _END)
            if upcoming is _END:
                self._gradients.end_of_dataloader = True
            self._yielded += 1
            yield send_to_device(current, self.device, self._non_blocking) if self._move else current
            current = upcoming
        self._gradients.end_of_dataloader = False
        self._finished = True

    def state_dict(self) -> dict[str, int] | None:
        """Where the data stands, for loaders whose order mixprec owns (None for kept loaders)."""
        if self.batch_sampler is None:
            return None
        if self._resume is not None:  # loaded or set, not iterated yet
            epoch, batches = self._resume
        elif self._finished or (self._started and self._yielded >= len(self.batch_sampler)):
            # every batch handed out (even if the loop has not asked for the next one yet): epoch done
            epoch, batches = self.epoch + 1, 0
        else:
            epoch, batches = self.epoch, (self._yielded if self._started else 0)
        return {"epoch": epoch, "batches": batches, "seed": self.batch_sampler.seed}

    def set_shuffle_seed(self, seed: int) -> None:
        """Shuffle as if the DataLoader's generator had been seeded with ``seed`` when it was prepared (the
        Trainer's ``data_seed`` changed after it built the loader). No effect on a loader that does not shuffle
        or whose order is its own."""
        if self.batch_sampler is not None and self.batch_sampler.shuffle:
            self.batch_sampler.seed = _draw_seed(torch.Generator().manual_seed(int(seed)))

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues epoch ``state["epoch"]`` after ``state["batches"]`` batches."""
        if self.batch_sampler is None:
            return
        self.batch_sampler.seed = int(state["seed"])
        self._resume = (int(state["epoch"]), int(state["batches"]))
        self._started, self._finished = False, False

    def __getattr__(self, name: str) -> Any:
        if name in ("_loader", "base_loader"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __repr__(self) -> str:
        return f"PreparedDataLoader({self.base_loader!r}, device={str(self.device)!r})"


_END = object()


class SkippedDataLoader:
    """What ``accelerator.skip_first_batches(loader, n)`` returns: iterating it runs the prepared loader's
    next epoch from batch ``n`` (without reading the batches before it, when mixprec owns the order); the
    loader itself then goes on with the epoch after. Other attributes are the loader's."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int) -> None:
        _check_skip(num_batches)
        self.loader = loader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Any]:
        if self.loader.batch_sampler is not None and self.num_batches > len(self.loader):
            raise ValueError(
                f"skip_first_batches(num_batches={self.num_batches}): the epoch has only {len(self.loader)} batches"
            )
        epoch = self.loader._next_epoch()
        self.loader._resume = None
        yield from self.loader._iterate(epoch, self.num_batches)

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"SkippedDataLoader({self.loader!r}, num_batches={self.num_batches})"


def prepare_dataloader(
    loader: DataLoader,
    strategy: DistributedStrategy,
    gradients: Accumulation,
    non_blocking: bool = False,
    dispatch: bool | None = None,
) -> PreparedDataLoader:
    """Wrap (and, when its order is known, rebuild) ``loader``; see the module docstring. ``dispatch``: the
    main process reads the batches and sends them (True; None: for an IterableDataset only) in several
    processes (:mod:`mixprec.loaders.dispatch`)."""
    world = strategy.num_processes
    # already split per process (a DistributedSampler, the Trainer's sharded stream): kept as it is
    split = hasattr(loader.sampler, "num_replicas") or hasattr(loader.dataset, "num_replicas")
    if not split and world > 1 and (dispatch or (dispatch is None and isinstance(loader.dataset, IterableDataset))):
        return PreparedDataLoader(DispatchingLoader(loader, strategy), strategy.device, gradients, None, non_blocking)
    plan = None if split else _split_plan(loader, world)
    if plan is None:
        return PreparedDataLoader(loader, strategy.device, gradients, non_blocking=non_blocking)
    shuffle, generator = plan
    seed = _shared_seed(strategy, generator) if shuffle else 0
    sampler = ShardedBatchSampler(
        len(loader.dataset),
        loader.batch_size,
        num_processes=world,
        process_index=strategy.process_index,
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
    )
    return PreparedDataLoader(loader, strategy.device, gradients, sampler, non_blocking=non_blocking)


def _split_plan(loader: DataLoader, world: int) -> tuple[bool, torch.Generator | None] | None:
    """``(shuffle, generator)`` when mixprec can own the order, None to keep the loader as it is."""
    sampler = loader.sampler
    if isinstance(loader.dataset, IterableDataset):
        reason = "an IterableDataset"
    elif loader.batch_size is None:
        reason = "batch_size=None (automatic batching off)"
    elif type(loader.batch_sampler) is not torch.utils.data.BatchSampler:
        reason = f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    elif type(sampler) is SequentialSampler:
        return False, None
    elif type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return True, sampler.generator if sampler.generator is not None else loader.generator
    else:
        reason = f"a custom sampler ({type(sampler).__name__})"
    if world == 1:
        return None
    raise TypeError(
        f"prepare(): cannot split a DataLoader with {reason} across {world} processes; use "
        "DataLoader(dataset, batch_size=..., shuffle=True/False), give it a sampler that splits the data "
        "itself (torch.utils.data.DistributedSampler), or let the main process read and send the batches: "
        "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))"
    )


def _draw_seed(generator: torch.Generator | None) -> int:
    """The shuffle seed a loader's generator gives (its first draw; torch's global RNG when None)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def _shared_seed(strategy: DistributedStrategy, generator: torch.Generator | None) -> int:
    seed = torch.tensor([_draw_seed(generator)], dtype=torch.int64, device=strategy.device)
    return int(strategy.broadcast(seed, src=0).item())  # the main process's draw, everywhere


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """``dataloader`` starting at batch ``num_batches`` of its next epoch, as accelerate's: a prepared one
    through :meth:`PreparedDataLoader.skip_first_batches`; a plain DataLoader as a new DataLoader over the same
    dataset whose batch sampler drops the first ``num_batches`` index batches (no sample is read for them)."""
    if isinstance(dataloader, (PreparedDataLoader, SkippedDataLoader)):
        base = dataloader if isinstance(dataloader, PreparedDataLoader) else dataloader.loader
        return base.skip_first_batches(num_batches)
    if not isinstance(dataloader, DataLoader) or dataloader.batch_sampler is None:
        raise TypeError(
            f"skip_first_batches(dataloader=...): got {type(dataloader).__name__}; pass a DataLoader with a batch "
            "size, or prepare it first (accelerator.prepare(loader)) and skip on the prepared one"
        )
    sampler = SkipBatchSampler(dataloader.batch_sampler, num_batches)
    return _rebuild(dataloader, sampler, dataloader.generator)


def _check_skip(num_batches: Any) -> None:
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}): num_batches must be an integer >= 0")


class SkipBatchSampler(torch.utils.data.Sampler[list[int]]):
    """The batches of ``batch_sampler`` after the first ``num_batches`` (what a skipped plain DataLoader uses)."""

    def __init__(self, batch_sampler: Any, num_batches: int) -> None:
        _check_skip(num_batches)
        self.batch_sampler = batch_sampler
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.num_batches, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.num_batches, 0)


def _rebuild(loader: DataLoader, batch_sampler: Any, generator: torch.Generator | None = None) -> DataLoader:
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": torch.Generator() if generator is None else generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)
