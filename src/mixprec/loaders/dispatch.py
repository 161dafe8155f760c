"""Batches dispatched by the main process (``DataLoaderConfiguration(dispatch_batches=True)``, as accelerate's).

For data only the main process can read in order — an ``IterableDataset`` (a stream, a generator), a sampler
that cannot be split — the main process iterates the DataLoader alone, takes one batch per process, and
broadcasts them; each process keeps its own. Every sample is seen once and every process runs the same number
of steps, by the rules of mixprec's split of map-style data (:mod:`mixprec.loaders.sharding`: a short last
step pooled and split evenly, a tail smaller than the number of processes folded into the step before it).

Cost: the main process reads all the data, and each step broadcasts every process's batch to all of them
(as accelerate's dispatcher does). Batches must be tensors, or dicts/lists/tuples of tensors whose first
dimension counts the samples.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from mixprec import tree as pytree
from mixprec.strategies.process_state import split_share

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from mixprec.strategies.strategy import DistributedStrategy

_END = object()


class DispatchingLoader:
    """Iterates like the DataLoader it wraps, each process receiving its batches from the main process."""

    sampler = None  # the order is the main process's reading order; nothing to set an epoch on

    def __init__(self, loader: DataLoader, strategy: DistributedStrategy) -> None:
        self.loader = loader
        self.strategy = strategy

    def __len__(self) -> int:
        batches = len(self.loader)  # a TypeError for loaders without a length, as torch's
        world = self.strategy.num_processes
        return max(-(-batches // world), 1) if batches else 0

    def __iter__(self) -> Iterator[Any]:
        rank, world = self.strategy.process_index, self.strategy.num_processes
        reader = _Reader(iter(self.loader), world) if self.strategy.is_main_process else None
        while True:
            # the main process's verdict travels with the batches: an error there must end every process's
            # loop, not leave the others waiting in the next broadcast
            kind, body = self.strategy.broadcast_object(reader.next_message() if reader is not None else None)
            if kind == "end":
                return
            if kind == "error":
                raise body
            yield body[rank] if len(body) == world else _pooled_share(body, rank, world)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class _Reader:
    """The main process's side: groups of one batch per process, one group of look-ahead for the fold."""

    def __init__(self, source: Iterator[Any], world: int) -> None:
        self.source, self.world = source, world
        self.pending: list[Any] | None = None

    def next_message(self) -> tuple[str, Any]:
        try:
            group = self.pending if self.pending is not None else _take(self.source, self.world)
            if not group:
                return ("end", None)
            upcoming = _take(self.source, self.world)
            if upcoming and _count(upcoming) < self.world:  # too few to give every process one: fold
                group, upcoming = group + upcoming, []
            self.pending = upcoming
            if _count(group) < self.world:
                raise ValueError(
                    f"DataLoaderConfiguration(dispatch_batches=True): {_count(group)} samples cannot give "
                    f"{self.world} processes one each"
                )
            return ("batches", group)
        except Exception as err:  # noqa: BLE001 - sent to every process, raised there
            return ("error", _picklable(err))


def _picklable(err: Exception) -> Exception:
    try:
        pickle.dumps(err)
        return err
    except Exception:  # noqa: BLE001 - an exception type that cannot travel: its text can
        return RuntimeError(f"{type(err).__name__}: {err}")


def _take(source: Iterator[Any], n: int) -> list[Any]:
    out = []
    for _ in range(n):
        batch = next(source, _END)
        if batch is _END:
            break
        out.append(_checked(batch))
    return out


def _checked(batch: Any) -> Any:
    leaves = pytree.tree_leaves(batch)
    if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
        kinds = sorted({type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor)}) or ["0-d tensor"]
        raise TypeError(
            "DataLoaderConfiguration(dispatch_batches=True): the main process splits batches by their first "
            f"dimension, so every leaf of a batch must be a tensor with one; got {', '.join(kinds)}. Return "
            "tensors from the collate_fn, or leave dispatch_batches off"
        )
    return batch


def _count(batches: list[Any]) -> int:
    return sum(pytree.tree_leaves(b)[0].shape[0] for b in batches)


def _pooled_share(batches: list[Any], rank: int, world: int) -> Any:
    """This process's slice of the samples of ``batches`` pooled together (contiguous, sizes within one)."""
    flat = [pytree.tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise TypeError("DataLoaderConfiguration(dispatch_batches=True): batches of one epoch differ in structure")
    pooled = [torch.cat(parts) for parts in zip(*(leaves for leaves, _ in flat))]
    return pytree.tree_unflatten([split_share(t, rank, world) for t in pooled], spec)
