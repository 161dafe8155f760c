"""The Trainer's datasets to DataLoaders, with a reproducible order and an exact position to resume from.

The Trainer builds plain DataLoaders (:func:`make_loader`) and hands them to ``Accelerator.prepare``, which owns
the split across processes, the order (epoch ``e``'s depends on ``(shuffle seed, e)`` only) and the position
that ``save_state`` saves, so a resumed run starts at exactly the batch the uninterrupted one would have read next.

Accepted datasets: anything map-style with ``__len__`` and ``__getitem__`` (torch ``Dataset``, a list of dicts,
a Hugging Face ``datasets.Dataset`` split), and streams (a torch or ``datasets`` ``IterableDataset``) when
``max_steps`` says how long to train, as in HF; a stream is sharded across processes by :class:`ShardedStream`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset


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


def is_stream(dataset: Any) -> bool:
    """A dataset read front to back (no random access): torch's or ``datasets``' IterableDataset."""
    if isinstance(dataset, IterableDataset):
        return True
    return not hasattr(dataset, "__getitem__") and hasattr(dataset, "__iter__") and not hasattr(dataset, "__len__")


def check_dataset(dataset: Any, name: str) -> int | None:
    """Return ``len(dataset)`` (None for a stream); raise ValueError for an empty dataset or an unusable one."""
    if is_stream(dataset):
        return None
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"{name} must be map-style (with __len__ and __getitem__: a torch Dataset, a list of dicts or a "
            f"datasets.Dataset split) or a stream (an IterableDataset), got {type(dataset).__name__}"
        )
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{name} is empty: it has no examples to train or evaluate on")
    return n


# -- collation -----------------------------------------------------------------------------------------


def _padding_collator(processing_class: Any) -> Any:
    """transformers' ``DataCollatorWithPadding`` over a tokenizer or feature extractor; None for anything else
    (transformers is loaded already where one was made)."""
    transformers = sys.modules.get("transformers")
    kinds = (
        getattr(transformers, "PreTrainedTokenizerBase", ()),
        getattr(transformers, "SequenceFeatureExtractor", ()),
    )
    if transformers is None or not isinstance(processing_class, kinds):
        return None
    return transformers.DataCollatorWithPadding(processing_class)


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
    """The names ``model.forward`` takes, which ``remove_unused_columns`` keeps (HF's rule: its named
    parameters, even beside a ``**kwargs``, as transformers 5's models all have one for attention options);
    None, keep everything, when it names none (``forward(**batch)``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named or None


class ColumnFilter:
    """Drop example keys the model cannot take before collating (picklable, so it works with workers)."""

    def __init__(self, collator: Callable[[list[Any]], Any], keep: set[str] | None) -> None:
        self.collator = collator
        self.keep = keep
        """The keys kept (the Trainer's: the forward's names and the label columns); None keeps every key."""

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        collator: Any,
        remove_unused_columns: bool,
        label_names: Sequence[str],
        processing_class: Any = None,
    ) -> ColumnFilter:
        """The Trainer's filter: ``collator`` over the keys ``model``'s forward takes and the label columns, or
        over every key without ``remove_unused_columns``. With no collator, HF's default: transformers'
        ``DataCollatorWithPadding`` for a tokenizer or feature extractor given as ``processing_class`` (each
        batch padded to its longest), else :func:`default_collator`."""
        keep = forward_arg_names(model) if remove_unused_columns else None
        if keep is not None:  # HF keeps the label columns too ("label"/"label_ids": collators rename them)
            keep |= {*label_names, "label", "label_ids"}
        return cls(collator or _padding_collator(processing_class) or default_collator, keep)

    def __call__(self, features: list[Any]) -> Any:
        if self.keep is not None and features and isinstance(features[0], Mapping):
            features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collator(features)


# -- loaders -------------------------------------------------------------------------------------------


def make_loader(
    dataset: Any,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any],
    *,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> DataLoader:
    """A plain DataLoader for ``Accelerator.prepare``, which splits it across processes, moves its batches to
    the device and saves its position. Its private generator, seeded with ``seed``, fixes the shuffle seed
    (the Accelerator draws it from there) and keeps the global RNG out of the data order: creating a DataLoader
    iterator draws a worker seed from its generator, and the global RNG's draw would shift a resumed run's
    dropout masks."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and not is_stream(dataset),  # a stream's order is its own
        collate_fn=collate_fn,
        num_workers=num_workers,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(int(seed)),
        **loader_kwargs,
    )


class ShardedStream(IterableDataset):
    """A stream split across ``num_replicas`` processes: of every ``batch_size * num_replicas`` examples,
    process ``rank`` takes the ``rank``-th block of ``batch_size``. Every process gets the same number of whole
    batches (DDP's collectives need that), and no example is read twice: under several processes a last group
    too short to give every process a whole batch is dropped (HF's IterableDatasetShard pads it with repeats
    instead), in evaluation too, so a distributed evaluation of a stream leaves out up to
    ``batch_size * num_replicas - 1`` trailing examples. One process reads the whole stream.

    Resume: a stream cannot seek, so ``skip_batches(n)`` makes the next pass read and discard this process's
    first ``n`` batches (their groups), as HF's Trainer skips batches on resume. The Trainer calls it with the
    checkpoint's data position; the data seen after the resume is the data the uninterrupted run would have
    read, provided the stream yields the same examples in the same order when read again.
    """

    def __init__(self, dataset: Any, batch_size: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.num_replicas, self.rank = int(num_replicas), int(rank)  # num_replicas: "already split" to prepare()
        self._skip = 0

    def skip_batches(self, n: int) -> None:
        self._skip = int(n)

    def pass_begun(self) -> None:
        """The loader has begun a pass (its workers, if any, took their copies): the skip asked for is that
        pass's, no later one's (a worker clears only its own copy's)."""
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        """Passed on to a stream that reshuffles per pass (a ``datasets`` stream's ``shuffle``), as HF's Trainer."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Any:
        skip, self._skip = self._skip * self.batch_size * self.num_replicas, 0  # when the pass begins
        return self._examples(skip)

    def _examples(self, skip: int) -> Any:
        group = self.batch_size * self.num_replicas
        worker = torch.utils.data.get_worker_info()  # DataLoader workers share the groups out too
        if self.num_replicas == 1 and worker is None:
            # one process: nothing to split, so nothing is dropped (the last batch may be short)
            for i, example in enumerate(self.dataset):
                if i >= skip:
                    yield example
            return
        start, stop = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        block: list[Any] = []
        groups = 0
        for i, example in enumerate(self.dataset):
            if i < skip:
                continue
            block.append(example)
            if len(block) == group:
                if groups % workers == worker_id:
                    yield from block[start:stop]
                block, groups = [], groups + 1
        if block and self.num_replicas == 1 and groups % workers == worker_id:
            yield from block  # one process's short last batch, from the worker whose turn it is
