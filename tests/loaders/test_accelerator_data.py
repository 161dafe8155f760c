"""The prepared DataLoader and the split of an epoch across processes (sharding.py, data.py)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from mixprec import Accelerator
from mixprec.accelerator import send_to_device
from mixprec.loaders.sharding import ShardedBatchSampler


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


# -- accelerate's mid-epoch resume: skip_first_batches, DataLoaderConfiguration ----------------------------


class Counting(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


def test_skip_first_batches_starts_the_next_epoch_at_that_batch_without_reading_the_ones_before() -> None:
    def prepared(data: torch.utils.data.Dataset):
        torch.manual_seed(0)
        accelerator = Accelerator(verbose=False)
        return accelerator, accelerator.prepare(DataLoader(data, batch_size=3, shuffle=True))

    _, reference = prepared(list(range(10)))
    epochs = [[b.tolist() for b in reference] for _ in range(3)]  # epochs 0, 1, 2 in full
    data = Counting(10)
    accelerator, loader = prepared(data)
    assert [b.tolist() for b in loader] == epochs[0]
    data.reads = 0
    skipped = accelerator.skip_first_batches(loader, 2)
    assert len(skipped) == 2
    assert [b.tolist() for b in skipped] == epochs[1][2:]  # epoch 1 from its third batch
    assert data.reads == 4  # the two skipped batches (6 samples) were never read
    assert [b.tolist() for b in loader] == epochs[2]  # the loader itself goes on with epoch 2


def test_skip_after_load_state_does_not_skip_twice() -> None:
    # accelerate's scripts call skip_first_batches(loader, resume_step) after load_state; mixprec's
    # load_state already puts the loader at that batch, so the count is from the epoch's start.
    accelerator = Accelerator(verbose=False)
    loader = accelerator.prepare(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    it = iter(loader)
    done = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    loader.load_state_dict(state)
    assert [b.tolist() for b in accelerator.skip_first_batches(loader, state["batches"])] == rest
    assert len(done + rest) == 6


def test_skip_first_batches_on_a_plain_loader_drops_index_batches() -> None:
    from mixprec import skip_first_batches

    data = Counting(10)
    skipped = skip_first_batches(DataLoader(data, batch_size=4), 1)
    assert [b.tolist() for b in skipped] == [[4, 5, 6, 7], [8, 9]] and data.reads == 6 and len(skipped) == 2
    with pytest.raises(ValueError, match="num_batches must be an integer >= 0"):
        skip_first_batches(DataLoader(data, batch_size=4), -1)
    with pytest.raises(TypeError, match="pass a DataLoader with a batch size, or prepare it first"):
        skip_first_batches([1, 2, 3], 1)


def test_dataloader_configuration_accepts_mixprecs_split_and_refuses_the_others_by_name() -> None:
    from mixprec import DataLoaderConfiguration

    config = DataLoaderConfiguration(even_batches=False, use_seedable_sampler=True, non_blocking=True)
    assert Accelerator(dataloader_config=config, verbose=False).config.non_blocking is True
    assert DataLoaderConfiguration(dispatch_batches=True).dispatch_batches  # main process reads (dispatch.py)
    with pytest.raises(ValueError, match=r"split_batches=True\) is not supported: pass the per-process batch"):
        DataLoaderConfiguration(split_batches=True)
    with pytest.raises(ValueError, match="data_seed=3.*generator=torch.Generator"):
        DataLoaderConfiguration(data_seed=3)
    with pytest.raises(TypeError, match="dataloader_config=.*expected a DataLoaderConfiguration, got dict"):
        Accelerator(dataloader_config={"dispatch_batches": False}, verbose=False)


def test_one_split_rule_for_samples_split_between_processes_and_dispatched_batches():
    from mixprec.strategies.process_state import share_bounds, split_share

    for n in range(0, 12):
        for count in range(1, 5):
            bounds = [share_bounds(n, i, count) for i in range(count)]
            assert [b[0] for b in bounds] == [0] + [b[1] for b in bounds[:-1]] and bounds[-1][1] == n  # tiles
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert [split_share(list(range(n)), i, count) for i in range(count)] == [
                list(range(lo, hi)) for lo, hi in bounds
            ]
