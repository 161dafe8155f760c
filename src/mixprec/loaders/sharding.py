"""Split an epoch's samples across processes: each sample exactly once, the same number of batches everywhere.

``torch.utils.data.DistributedSampler`` pads the last batch with repeated samples (or drops the tail) so
every process gets the same count; repeated samples count twice in the loss and in metrics. Here an epoch is
cut into global steps of ``batch_size * num_processes`` consecutive indices of the epoch's order, and each
step into one contiguous slice per process:

- full steps give every process exactly ``batch_size`` samples;
- a last partial step with at least one sample per process is split as evenly as possible (sizes differ
  by at most one);
- a tail smaller than the number of processes is folded into the step before it (a few processes get
  ``batch_size + 1`` samples), because an empty batch cannot run and every process must run the same number
  of steps (each step's backward is a collective);
- ``drop_last=True`` drops the partial step instead (each sample at most once, every batch full).

The order of epoch ``e`` depends only on ``(seed, e)``, so every process computes the same one without
communicating, and a resumed run can start at any batch without reading the ones before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from mixprec.strategies.process_state import share_bounds


class ShardedBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices for one process (see the module docstring for the split)."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        num_processes: int = 1,
        process_index: int = 0,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} is not in [0, {num_processes})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0
        self._steps = self._plan()

    def _plan(self) -> list[tuple[int, int]]:
        """``(first, end)`` index ranges of the epoch order, one per global step."""
        n, world = self.num_samples, self.num_processes
        per_step = self.batch_size * world
        full, rest = divmod(n, per_step)
        steps = [(s * per_step, (s + 1) * per_step) for s in range(full)]
        if rest and not self.drop_last:
            if rest >= world or full == 0:
                steps.append((full * per_step, n))
            else:
                steps[-1] = (steps[-1][0], n)
        if not steps or steps[-1][1] - steps[-1][0] < world:
            what = "one full global batch" if self.drop_last else "one sample per process"
            raise ValueError(
                f"a dataset of {n} samples cannot give {world} process(es) {what} "
                f"(batch_size={self.batch_size}, drop_last={self.drop_last})"
            )
        return steps

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Choose the epoch (its order) and how many of its batches to skip (a resume)."""
        if not 0 <= start <= len(self._steps):
            raise ValueError(f"cannot skip {start} batches of an epoch with {len(self._steps)}")
        self.epoch = int(epoch)
        self.start = int(start)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        for first, end in self._steps[self.start :]:
            lo, hi = share_bounds(end - first, self.process_index, self.num_processes)
            yield order[first + lo : first + hi]

    def __len__(self) -> int:
        """Batches in a full epoch (the same on every process)."""
        return len(self._steps)

    def batches_at(self, batches: int, num_processes: int) -> int:
        """Where ``batches`` global steps of an epoch cut by ``num_processes`` processes (a checkpoint of another
        world size) fall in this split: the steps its samples complete here, so a resume skips no sample and
        reads at most one global batch again."""
        saved = ShardedBatchSampler(
            self.num_samples, self.batch_size, num_processes=num_processes, drop_last=self.drop_last
        )
        samples = saved._steps[min(batches, len(saved._steps)) - 1][1] if batches > 0 else 0
        return sum(1 for _, end in self._steps if end <= samples)


def epoch_seed(seed: int, epoch: int) -> int:
    # Distinct seeds per (seed, epoch); 2**31 - 1 is prime, so nearby seeds and epochs do not collide.
    return (seed * 1_000_003 + epoch * (2**31 - 1)) % (2**63 - 1)
