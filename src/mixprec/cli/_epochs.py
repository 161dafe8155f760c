"""What an epoch is in ``mixprec train``: a fixed number of chunks, new ones each epoch.

The default corpus holds about 11,000 chunks of 256 bytes, more than a few-minute run trains on, so "one
pass over the data" would make the default run a fraction of one epoch and evaluate once, at the very end.
Instead an epoch is ``chunks_per_epoch`` chunks (or every chunk, if the split has fewer): the training split
is put in one seeded random order, and epoch ``e`` takes the ``e``-th slice of it, wrapping around when the
split is used up. So a run of E epochs evaluates E times and, until it wraps, never sees a chunk twice,
which keeps the validation loss a measure of generalisation rather than memorisation.

The Trainer shuffles within the epoch (its sampler permutes ``range(len(dataset))`` per epoch) and must tell
the dataset which epoch it is in: :class:`EpochCallback` calls :meth:`EpochChunks.set_epoch` at every epoch
start, including the epoch a resumed run starts in, so a resume sees exactly the chunks the interrupted run
would have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from mixprec.trainer.callbacks import TrainerCallback


class EpochChunks(Dataset):
    """``chunks_per_epoch`` items of ``base`` per epoch: slice ``epoch`` of a fixed random order of ``base``.

    Items are read from ``base`` on access (no copy); the order is ``len(base)`` ints on the host.
    """

    def __init__(self, base: Any, chunks_per_epoch: int, seed: int) -> None:
        if chunks_per_epoch <= 0:
            raise ValueError(f"chunks_per_epoch must be > 0, got {chunks_per_epoch}")
        self.base = base
        self.chunks_per_epoch = min(chunks_per_epoch, len(base))
        # a private generator: the order must not depend on (or disturb) the global RNG the model init used
        self._order = torch.randperm(len(base), generator=torch.Generator().manual_seed(seed)).tolist()
        self.epoch = 0

    @property
    def is_full_pass(self) -> bool:
        """True when an epoch is the whole of ``base``."""
        return self.chunks_per_epoch == len(self.base)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.chunks_per_epoch

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.chunks_per_epoch:
            raise IndexError(f"EpochChunks index {index} out of range for {self.chunks_per_epoch} chunks")
        position = (self.epoch * self.chunks_per_epoch + index) % len(self._order)
        return self.base[self._order[position]]


class EpochCallback(TrainerCallback):
    """Tells an :class:`EpochChunks` the Trainer's epoch at every epoch start."""

    def __init__(self, dataset: EpochChunks) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - HF's callback signature
        # state.epoch is fractional and already counts the finished epochs (2.0 at the start of the third;
        # 2.4 in a run resumed 40% into it), so its floor is the epoch being started
        self.dataset.set_epoch(int(state.epoch or 0))


def evenly_spaced(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)`` (a deterministic, representative subset)."""
    if k >= n:
        return list(range(n))
    return [i * n // k for i in range(k)]
