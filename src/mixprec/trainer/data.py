"""Datasets to DataLoaders with a reproducible order and an exact position to resume from.

The order of epoch ``e`` is a permutation drawn from a generator seeded with ``(data_seed, e)`` alone, never
from the global RNG, so it does not depend on what else consumed random numbers (model init, dropout, a
resume). The position is (epoch, micro-batches consumed): resuming starts the sampler ``consumed * batch``
indices into that same permutation, so the resumed run sees exactly the batches the uninterrupted one would
have seen next. The DataLoader also gets its own generator, because creating a DataLoader iterator otherwise
draws a worker seed from the global RNG, which would make a resumed run's dropout masks differ.

Accepted datasets: anything map-style with ``__len__`` and ``__getitem__`` (torch ``Dataset``, a list of dicts,
a Hugging Face ``datasets.Dataset`` split). Items that are dicts are collated key by key into tensors; string
columns, and keys the model's forward does not take, are dropped (``remove_unused_columns``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler


@dataclass
class DataPosition:
    """Where the training data stands: ``batches_consumed`` micro-batches of ``epoch`` were trained on."""

    epoch: int = 0
    batches_consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataPosition:
        return cls(int(values["epoch"]), int(values["batches_consumed"]))


def check_dataset(dataset: Any, name: str) -> int:
    """Return ``len(dataset)``; raise ValueError for an empty dataset or one without random access."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"{name} must be map-style (with __len__ and __getitem__: a torch Dataset, a list of dicts or a "
            f"datasets.Dataset split), got {type(dataset).__name__}; an exact resume needs random access"
        )
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{name} is empty: it has no examples to train or evaluate on")
    return n


class ResumableSampler(Sampler[int]):
    """Indices of one epoch: a seeded permutation (or ``range`` when ``shuffle=False``), sharded across
    ``num_replicas`` processes like ``DistributedSampler`` (padded by wrapping so every process gets the same
    count, hence the same number of steps), starting ``start`` indices into this process's shard."""

    def __init__(self, size: int, seed: int, shuffle: bool = True, num_replicas: int = 1, rank: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.per_replica = math.ceil(size / num_replicas)
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Choose the epoch (its permutation) and how many of this process's indices to skip."""
        if not 0 <= start <= self.per_replica:
            raise ValueError(f"cannot skip {start} samples of an epoch with {self.per_replica}")
        self.epoch = epoch
        self.start = start

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        total = self.per_replica * self.num_replicas
        order += order[: total - len(order)]  # pad by wrapping (DistributedSampler's rule)
        return order[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :])

    def __len__(self) -> int:
        return self.per_replica - self.start


def _epoch_seed(seed: int, epoch: int) -> int:
    # Distinct, stable seeds per (seed, epoch); 2**31 - 1 is prime, so nearby seeds don't collide.
    return (int(seed) * 1_000_003 + int(epoch) * (2**31 - 1)) % (2**63 - 1)


# -- collation -----------------------------------------------------------------------------------------


def default_collator(features: Sequence[Any]) -> Any:
    """Stack a list of examples into a batch.

    Dict examples become a dict of tensors (tensors stacked; numbers, numpy arrays and equal-length lists
    turned into tensors); keys holding strings are dropped; "label"/"label_ids" are renamed "labels" (HF's
    convention). Anything else goes to ``torch.utils.data.default_collate``.
    """
    first = features[0]
    if not isinstance(first, Mapping):
        return torch.utils.data.default_collate(list(features))
    batch: dict[str, Any] = {}
    for key in first:
        values = [f[key] for f in features]
        if isinstance(values[0], str) or values[0] is None:
            continue
        target = "labels" if key in ("label", "label_ids") else key
        batch[target] = _stack(key, values)
    return batch


def _stack(key: str, values: list[Any]) -> torch.Tensor:
    v = values[0]
    try:
        if isinstance(v, torch.Tensor):
            return torch.stack(values)
        if isinstance(v, np.ndarray):
            return torch.as_tensor(np.stack(values))
        return torch.tensor(values)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(
            f"cannot stack the {key!r} values of a batch into one tensor ({err}); examples of different lengths "
            "need padding: pass a data_collator that pads (e.g. transformers.DataCollatorWithPadding)"
        ) from None


def forward_arg_names(model: torch.nn.Module) -> set[str] | None:
    """Keyword names ``model.forward`` accepts, or None when it takes ``**kwargs`` (accept everything)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class ColumnFilter:
    """Drop example keys the model cannot take before collating (picklable, so it works with workers)."""

    def __init__(self, collator: Callable[[list[Any]], Any], keep: set[str] | None) -> None:
        self.collator = collator
        # "label" and "label_ids" are kept because the default collator renames them "labels".
        self.keep = None if keep is None else keep | ({"label", "label_ids"} if "labels" in keep else set())

    def __call__(self, features: list[Any]) -> Any:
        if self.keep is not None and features and isinstance(features[0], Mapping):
            features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collator(features)


# -- loaders -------------------------------------------------------------------------------------------


def make_loader(
    dataset: Any,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any],
    sampler: ResumableSampler,
    *,
    num_workers: int = 0,
    drop_last: bool = False,
) -> DataLoader:
    """A DataLoader over ``sampler`` with a private generator (see the module docstring for why)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(sampler.seed),
    )


def start_epoch(loader: DataLoader, epoch: int, batches_consumed: int = 0) -> None:
    """Point ``loader`` at ``epoch``, skipping the first ``batches_consumed`` batches of this process.

    Exact because batches are consecutive slices of the epoch's index list. Also reseeds the loader's own
    generator per epoch, so worker seeds match an uninterrupted run's.
    """
    sampler = loader.sampler
    if not isinstance(sampler, ResumableSampler):
        raise TypeError("start_epoch() needs a loader built by make_loader()")
    sampler.set_epoch(epoch, batches_consumed * loader.batch_size)
    if loader.generator is not None:
        loader.generator.manual_seed(_epoch_seed(sampler.seed, epoch) + 1)


def batches_per_epoch(loader: DataLoader) -> int:
    """Micro-batches in a full epoch for this process (independent of any skip in progress)."""
    sampler = loader.sampler
    n = sampler.per_replica if isinstance(sampler, ResumableSampler) else len(sampler)
    return n // loader.batch_size if loader.drop_last else math.ceil(n / loader.batch_size)


def count_tokens(batch: Any) -> int:
    """Tokens in a batch (``input_ids.numel()``: host metadata, no device sync); 0 when there are none."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def count_samples(batch: Any) -> int:
    """Examples in a batch: the leading dimension of its first tensor (no device sync)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0
