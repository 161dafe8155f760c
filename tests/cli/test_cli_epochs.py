"""An epoch of `mixprec train`: a fixed number of chunks, new ones every epoch until the split is used up."""

from __future__ import annotations

from types import SimpleNamespace

from mixprec.cli._epochs import EpochCallback, EpochChunks, evenly_spaced


def _epoch(ds: EpochChunks, epoch: int) -> list[int]:
    ds.set_epoch(epoch)
    return [ds[i] for i in range(len(ds))]


def test_epochs_are_disjoint_until_the_split_is_used_up_then_wrap():
    ds = EpochChunks(list(range(10)), chunks_per_epoch=3, seed=0)
    e0, e1, e2 = _epoch(ds, 0), _epoch(ds, 1), _epoch(ds, 2)
    assert len(ds) == 3
    assert len(set(e0 + e1 + e2)) == 9  # nine distinct chunks in three epochs
    wrapped = _epoch(ds, 3)  # positions 9, 10, 11 of the order: the last chunk, then the first two again
    assert wrapped[1:] == e0[:2] and wrapped[0] not in e0 + e1 + e2


def test_the_order_depends_on_the_seed_only():
    a = _epoch(EpochChunks(list(range(100)), 10, seed=1), 2)
    b = _epoch(EpochChunks(list(range(100)), 10, seed=1), 2)
    c = _epoch(EpochChunks(list(range(100)), 10, seed=2), 2)
    assert a == b and a != c


def test_a_small_split_is_one_full_pass_per_epoch():
    ds = EpochChunks(list(range(5)), chunks_per_epoch=100, seed=0)
    assert len(ds) == 5 and ds.is_full_pass
    assert sorted(_epoch(ds, 0)) == sorted(_epoch(ds, 7)) == list(range(5))


def test_callback_sets_the_epoch_being_started_also_after_a_resume():
    ds = EpochChunks(list(range(10)), 2, seed=0)
    cb = EpochCallback(ds)
    for state_epoch, expected in ((None, 0), (0.0, 0), (2.0, 2), (2.4, 2)):
        cb.on_epoch_begin(None, SimpleNamespace(epoch=state_epoch), None)
        assert ds.epoch == expected


def test_evenly_spaced():
    assert evenly_spaced(10, 3) == [0, 3, 6]
    assert evenly_spaced(3, 10) == [0, 1, 2]
