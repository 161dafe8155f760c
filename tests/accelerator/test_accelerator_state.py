"""save_state / load_state: a stopped run resumes exactly; a failed save leaves the old state; nothing
loaded can run code. Also the one-process DDP/FSDP2 paths (an in-memory process group)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import mixprec.checkpoint.folder_format as state_module
from conftest import TinyLM
from mixprec import Accelerator, DistributedType
from mixprec.checkpoint import UnsafeCheckpointError, write_manifest
from resumable_loop import DropoutLM, data, run, setup


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits for a core on this shared machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_stop_and_resume_continues_identically(precision: str, tmp_path: Path) -> None:
    # Uninterrupted: two epochs.
    reference = setup(precision, accumulation=2)
    run(*reference)
    run(*reference)
    # Interrupted after 3 batches of epoch 1 (mid accumulation window), resumed in fresh objects.
    first = setup(precision, accumulation=2)
    run(*first)
    run(*first, stop_after=3)
    first[0].save_state(tmp_path / "state")
    resumed = setup(precision, seed=123, accumulation=2)  # different init and shuffle seed: all overwritten
    resumed[0].load_state(tmp_path / "state")
    assert run(*resumed) == 10 - 3  # the rest of epoch 1
    for (name, p), q in zip(reference[1].named_parameters(), resumed[1].parameters()):
        assert torch.equal(p, q), f"{name} differs after resume"  # bit-exact on CPU
    assert reference[4].get_last_lr() == resumed[4].get_last_lr()
    assert reference[0].scaler.state_dict() == resumed[0].scaler.state_dict()
    for a, b in zip(reference[2].state.values(), resumed[2].state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_folder_layout_and_extra_json(tmp_path: Path) -> None:
    accelerator, *objects = setup("fp16")
    run(accelerator, *objects, stop_after=2)
    path = accelerator.save_state(tmp_path / "ckpt", extra_json={"trainer_state": {"global_step": 2}})
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "accelerator.json",
        "manifest.json",
        "model.safetensors",
        "optimizer.pt",
        "rng_state_0.pt",
        "scaler.json",
        "scheduler.pt",
        "trainer_state.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left behind


def test_a_failed_save_leaves_the_previous_state_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, model, optimizer, loader, scheduler = setup("fp32")
    run(accelerator, model, optimizer, loader, scheduler, stop_after=2)
    target = tmp_path / "state"
    accelerator.save_state(target)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    run(accelerator, model, optimizer, loader, scheduler, stop_after=2)  # move on, then crash while saving

    real = state_module.save_torch

    def crash_on_scheduler(obj, path):
        if Path(path).name == "scheduler.pt":
            raise OSError("disk full (simulated)")  # model and optimizer files are already written
        return real(obj, path)

    monkeypatch.setattr(state_module, "save_torch", crash_on_scheduler)
    with pytest.raises(OSError, match="simulated"):
        accelerator.save_state(target)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    fresh, fresh_model, *_ = setup("fp32", seed=9)
    fresh.load_state(target)
    assert all(torch.equal(saved[k], v) for k, v in fresh_model.state_dict().items())


def test_a_crash_between_the_renames_is_recovered(tmp_path: Path) -> None:
    accelerator, model, *_ = setup("fp32")
    target = accelerator.save_state(tmp_path / "state")
    os.rename(target, tmp_path / ".state.old")  # what a kill right after commit's first rename leaves
    fresh, fresh_model, *_ = setup("fp32", seed=4)
    fresh.load_state(target)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_MARKER}",))


_MARKER = Path("/tmp/mixprec-test-pickle-ran")


def test_a_booby_trapped_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    _MARKER.unlink(missing_ok=True)
    accelerator, *_ = setup("fp32")
    target = accelerator.save_state(tmp_path / "state")
    with open(target / "optimizer.pt", "wb") as f:
        pickle.dump({"state": _Payload()}, f, protocol=2)
    write_manifest(target)  # whoever planted it can update the checksums too
    fresh, *_ = setup("fp32")
    with pytest.raises(UnsafeCheckpointError, match="refusing to load .*optimizer.pt"):
        fresh.load_state(target)
    assert not _MARKER.exists(), "the pickle's payload ran"


def test_loading_into_different_objects_is_refused(tmp_path: Path) -> None:
    accelerator, *_ = setup("fp32")
    target = accelerator.save_state(tmp_path / "state")
    other = Accelerator(verbose=False)
    other.prepare(TinyLM())
    with pytest.raises(ValueError, match="holds 1 optimizers, this Accelerator prepared 0"):
        other.load_state(target)
    with pytest.raises(FileNotFoundError, match="not a folder written by save_state"):
        other.load_state(tmp_path)


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_one_process_ddp_and_fsdp2_train_and_round_trip(distributed: str, tmp_path: Path) -> None:
    """Asked for explicitly without a launcher, DDP/FSDP2 run in a one-process group (the same code path as
    many processes; the two-process runs are in test_distributed.py)."""
    accelerator, model, optimizer, loader, scheduler = setup("fp16")
    reference = [p.detach().clone() for p in model.parameters()]
    accelerator.end_training()
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="fp16", distributed=distributed, verbose=False)
    try:
        assert (
            acc.distributed_type == {"ddp": DistributedType.MULTI_CPU, "fsdp": DistributedType.FSDP}[distributed]
            and acc.num_processes == 1
        )
        m = DropoutLM()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m, opt, dl = acc.prepare(m, opt, DataLoader(data(), batch_size=4, shuffle=True))
        assert sorted(m.state_dict()) == sorted(n for n, _ in model.named_parameters())
        if distributed == "fsdp":  # the optimizer follows the sharded (DTensor) parameters
            assert all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
        losses = []
        for batch in dl:
            loss = m(batch["input_ids"], labels=batch["labels"]).loss
            acc.backward(loss)
            acc.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        acc.save_state(tmp_path / "s")
        before = acc._strategy.model_state_dict(m)
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        acc.load_state(tmp_path / "s")
        after = acc._strategy.model_state_dict(m)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert len(reference) == len(before)
    finally:
        acc.end_training()
