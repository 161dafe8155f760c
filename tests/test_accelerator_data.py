"""The prepared DataLoader and the split of an epoch across processes (sharding.py, data.py)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from mixprec import Accelerator
from mixprec.accelerator import send_to_device
from mixprec.accelerator.sharding import ShardedBatchSampler


def split(n: int, world: int, batch: int, drop_last: bool = False, epoch: int = 0) -> list[list[list[int]]]:
    """Every process's batches for one epoch."""
    out = []
    for rank in range(world):
        sampler = ShardedBatchSampler(
            n, batch, num_processes=world, process_index=rank, shuffle=True, seed=7, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize(
    ("n", "world", "batch"),
    [(36, 2, 4), (37, 2, 4), (33, 4, 4), (17, 4, 4), (5, 4, 1), (10, 3, 4), (100, 8, 3), (7, 1, 3), (4, 4, 2)],
)
def test_each_sample_once_and_the_same_number_of_batches_everywhere(n: int, world: int, batch: int) -> None:
    per_rank = split(n, world, batch)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(n))  # exactly once: no padding, no drop
    assert len({len(batches) for batches in per_rank}) == 1  # every process runs the same number of steps
    assert all(1 <= len(b) <= batch + 1 for batches in per_rank for b in batches)  # no empty batch
    assert all(len(b) == batch for batches in per_rank for b in batches[:-1])  # only the last step differs


def test_drop_last_keeps_full_batches_only() -> None:
    per_rank = split(37, 2, 4, drop_last=True)
    assert all(len(b) == 4 for batches in per_rank for b in batches)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)) == 32


def test_too_few_samples_for_the_processes_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 samples cannot give 4 process"):
        ShardedBatchSampler(3, 2, num_processes=4, process_index=0)


def test_epoch_order_depends_on_seed_and_epoch_only() -> None:
    assert split(20, 2, 2, epoch=1) == split(20, 2, 2, epoch=1)
    assert split(20, 2, 2, epoch=0) != split(20, 2, 2, epoch=1)


def test_prepared_loader_counts_epochs_and_resumes_mid_epoch() -> None:
    accelerator = Accelerator(verbose=False)
    torch.manual_seed(0)
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=3, shuffle=True))
    epoch0, epoch1 = [b.tolist() for b in loader], [b.tolist() for b in loader]
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == list(range(10))
    assert [len(b) for b in epoch0] == [3, 3, 3, 1]
    it = iter(loader)  # epoch 2: stop after two batches and record the position
    first_two = [next(it).tolist(), next(it).tolist()]
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["batches"] == 2
    rest = [b.tolist() for b in it]
    loader.load_state_dict(state)
    assert [b.tolist() for b in loader] == rest  # resumes at the third batch of epoch 2 without reading 1-2
    assert first_two and loader.state_dict() == {"epoch": 3, "batches": 0, "seed": state["seed"]}


def test_an_epoch_whose_last_batch_was_handed_out_counts_as_done() -> None:
    # A save right after the last step of an epoch (the loop has not asked for the next batch yet) must
    # resume at the next epoch, not replay the empty end of this one.
    accelerator = Accelerator(verbose=False)
    loader = accelerator.prepare(DataLoader(list(range(6)), batch_size=3, shuffle=True))
    for i, _ in enumerate(loader):
        if i == 1:
            state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 0
    loader.load_state_dict(state)
    assert len(list(loader)) == 2 and loader.state_dict()["epoch"] == 2


def test_torch_manual_seed_governs_the_shuffle() -> None:
    def order(seed: int) -> list[int]:
        torch.manual_seed(seed)
        loader = Accelerator(verbose=False).prepare(DataLoader(list(range(8)), batch_size=8, shuffle=True))
        return next(iter(loader)).tolist()

    assert order(1) == order(1) != order(2)


def test_keeps_loaders_it_cannot_reorder_in_one_process() -> None:
    accelerator = Accelerator(verbose=False)
    weighted = DataLoader(list(range(8)), batch_size=4, sampler=WeightedRandomSampler([1.0] * 8, 8))
    prepared = accelerator.prepare(weighted)
    assert prepared.batch_sampler is None and len(list(prepared)) == 2
    already_split = DataLoader(list(range(8)), batch_size=2, sampler=DistributedSampler(range(8), 2, 0))
    prepared = accelerator.prepare(already_split)
    assert sum(len(b) for b in prepared) == 4  # this rank's half, as the user's sampler says


def test_moves_nested_batches_to_the_device() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "nested": [torch.zeros(1), (torch.ones(1), "text")], "pair": Pair(torch.ones(1), 3)}
    moved = send_to_device(batch, "meta")
    assert moved["x"].device.type == "meta" and moved["nested"][0].device.type == "meta"
    assert moved["nested"][1][0].device.type == "meta" and moved["nested"][1][1] == "text"
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device.type == "meta" and moved["pair"].b == 3


def test_end_of_dataloader_is_known_on_the_last_batch() -> None:
    accelerator = Accelerator(verbose=False)
    loader = accelerator.prepare(DataLoader(list(range(5)), batch_size=2))
    flags = [accelerator._gradients.end_of_dataloader for _ in loader]
    assert flags == [False, False, True]
    assert not accelerator._gradients.end_of_dataloader
