"""save_state(async_save=True) (checkpoint/folder_format.py, checkpoint/background.py): the step goes on while the
folder is written; the folder is the state at the save, complete or absent; failures are raised, never lost."""

from __future__ import annotations

import gc
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import mixprec.checkpoint.folder_format as state_module
from conftest import SEQ, VOCAB, TinyLM, TinyOutput
from mixprec import Accelerator, Trainer, TrainingArguments
from mixprec.checkpoint import load_tensors, verify_manifest
from mixprec.checkpoint.staging import Staged


def data(n: int = 24) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row, "labels": (row + 1) % VOCAB} for row in ids]


def prepared():
    torch.manual_seed(0)
    acc = Accelerator(verbose=False, cpu=True)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data(), batch_size=4))
    return acc, model, optimizer, loader


def step(acc, model, optimizer, batch) -> None:
    acc.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def held_writer(monkeypatch):
    """The writer thread's model file waits on an event, so a test can look at the world mid-save."""
    gate, real = threading.Event(), state_module.save_tensors

    def slow(state, path, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(30)
        return real(state, path, *args, **kwargs)

    monkeypatch.setattr(state_module, "save_tensors", slow)
    return gate


def test_the_step_goes_on_while_the_folder_is_written_and_it_holds_the_state_at_the_save(tmp_path, held_writer):
    acc, model, optimizer, loader = prepared()
    batches = iter(loader)
    step(acc, model, optimizer, next(batches))
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    target = acc.save_state(tmp_path / "ckpt", async_save=True)
    assert not target.exists()  # not yet committed: a reader finds nothing half written
    step(acc, model, optimizer, next(batches))  # training continues while the writer waits
    assert not torch.equal(model.state_dict()["head.weight"], at_save["head.weight"])
    held_writer.set()
    acc.wait_for_checkpoint()
    verify_manifest(target)  # complete and sealed
    saved = load_tensors(target / "model.safetensors")
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)  # the state at the save, not after it
    step(acc, model, optimizer, next(batches))  # a second save reuses the first one's host copy: fresh values
    at_second = {k: v.clone() for k, v in model.state_dict().items()}
    second = acc.save_state(tmp_path / "ckpt2", async_save=True)
    acc.wait_for_checkpoint()
    saved = load_tensors(second / "model.safetensors")
    assert all(torch.equal(saved[k], at_second[k]) for k in at_second)
    acc.load_state(target)
    assert all(torch.equal(model.state_dict()[k], at_save[k]) for k in at_save)
    acc.end_training()


def test_a_failed_background_write_is_raised_at_the_next_save_and_the_previous_folder_is_intact(tmp_path, monkeypatch):
    acc, model, optimizer, loader = prepared()
    batches = iter(loader)
    step(acc, model, optimizer, next(batches))
    first = acc.save_state(tmp_path / "ckpt", async_save=True)
    acc.wait_for_checkpoint()
    real = state_module.save_torch

    def failing(obj, path, *args, **kwargs):
        if Path(path).name == "optimizer.pt":
            raise OSError(5, "Input/output error", str(path))
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(state_module, "save_torch", failing)
    step(acc, model, optimizer, next(batches))
    acc.save_state(tmp_path / "ckpt", async_save=True)  # returns; the writer fails behind it
    with pytest.raises(OSError, match="Input/output error"):
        acc.save_state(tmp_path / "other", async_save=True)  # the previous failure, before anything new starts
    verify_manifest(first)  # the first save, untouched by the failed one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no unfinished folder left behind
    acc.wait_for_checkpoint()  # raised once: nothing left to raise
    acc.end_training()


def test_a_script_that_exits_with_a_save_in_flight_still_commits_it(tmp_path):
    # The writer thread is not a daemon: Python finishes it before the interpreter exits, so a script's last
    # asynchronous save is complete on disk even without wait_for_checkpoint() or end_training().
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import mixprec.checkpoint.folder_format as state_module
from mixprec import Accelerator
real = state_module.save_tensors
def slow(*args, **kwargs):
    import time; time.sleep(1.0)
    return real(*args, **kwargs)
state_module.save_tensors = slow
acc = Accelerator(cpu=True, verbose=False)
model = acc.prepare(torch.nn.Linear(8, 8))
acc.save_state({str(tmp_path / "ckpt")!r}, async_save=True)
"""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.perf_counter() - started >= 1.0
    verify_manifest(tmp_path / "ckpt")


def test_trainer_async_save_checkpoints_are_complete_and_resume_exactly(tmp_path):
    def trainer(out: Path, max_steps: int) -> Trainer:
        torch.manual_seed(0)
        args = TrainingArguments(
            str(out),
            max_steps=max_steps,
            save_steps=2,
            save_total_limit=2,
            async_save=True,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            report_to="none",
            use_cpu=True,
            logging_steps=100,
        )
        return Trainer(model=TinyLM(), args=args, train_dataset=data())

    straight = trainer(tmp_path / "a", 6)
    straight.train()
    assert [p.name for p in sorted((tmp_path / "a").glob("checkpoint-*"))] == ["checkpoint-4", "checkpoint-6"]
    for folder in (tmp_path / "a").glob("checkpoint-*"):
        verify_manifest(folder)
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")  # as if stopped there
    resumed = trainer(tmp_path / "b", 6)
    resumed.train(resume_from_checkpoint=True)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_torchaos_8bit_optimizer_states_save_asynchronously_and_resume_exactly(tmp_path):
    # torchao's 8-bit states are tensor subclasses (codes, block scales, one shared map) without empty_like or
    # copy_: the async copy takes the plain tensors they hold and builds the states again around their copies
    # (`mixprec train --optim adamw_torch_8bit` saved asynchronously and crashed at its first checkpoint)
    pytest.importorskip("torchao.optim")

    def trainer(out: Path) -> Trainer:
        torch.manual_seed(0)
        args = TrainingArguments(
            str(out),
            max_steps=4,
            save_steps=2,
            async_save=True,
            optim="adamw_torch_8bit",
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            report_to="none",
            use_cpu=True,
            logging_steps=100,
        )
        return Trainer(model=TinyLM(width=128), args=args, train_dataset=data())  # 128x128: past 8-bit's minimum

    straight = trainer(tmp_path / "a")
    straight.train()
    states = [s for s in straight.optimizer.state_dict()["state"].values() if "exp_avg" in s]
    assert any(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in states)  # the subclass was saved
    verify_manifest(tmp_path / "a" / "checkpoint-2")
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")  # as if stopped there
    resumed = trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_async_save_is_refused_with_sharded_state() -> None:
    acc = Accelerator(cpu=True, distributed="fsdp", fsdp_state_dict_type="sharded", verbose=False)
    try:
        acc.prepare(torch.nn.Linear(4, 4))
        with pytest.raises(ValueError, match="async_save=True.*sharded.*not supported"):
            acc.save_state("unused", async_save=True)
    finally:
        acc.end_training()


def test_a_sync_save_after_an_async_one_lets_it_land_first(tmp_path, held_writer):
    acc, model, _, _ = prepared()
    acc.save_state(tmp_path / "a", async_save=True)
    threading.Timer(0.2, held_writer.set).start()
    acc.save_state(tmp_path / "b")  # waits for "a", then saves synchronously
    verify_manifest(tmp_path / "a")
    verify_manifest(tmp_path / "b")
    acc.end_training()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class NormedLM(TinyLM):
    """TinyLM with a BatchNorm: buffers that every training forward rewrites in place."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        hidden = self.norm(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        logits = self.head(torch.nn.functional.gelu(self.hidden(hidden)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return TinyOutput(loss=loss, logits=logits)


@pytest.fixture
def late_copy(monkeypatch):
    """The writer thread's host copy of the state starts 0.3 s late: long after the next step began."""
    real = Staged.copy

    def late(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        real(self)

    monkeypatch.setattr(Staged, "copy", late)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "step_in_backward"])
def test_an_async_folder_is_byte_identical_to_a_sync_one_though_the_next_step_runs_at_once(
    tmp_path, late_copy, in_backward
):
    # Planted: the copy of the weights and moments is made on the writer thread, 0.3 s late, and a whole train
    # step runs the moment save_state returns: its forward rewrites the BatchNorm's running statistics (which
    # the save must have copied at the call), its optimizer step (or, with step_in_backward, its backward) the
    # weights and moments (which must wait for the copy). The folder must be byte for byte what a synchronous
    # save at the call writes. Three times: the second save copies into the first one's buffers; the third
    # comes after load_state (new optimizer tensors: a new copy plan).
    torch.manual_seed(0)
    acc = Accelerator(verbose=False, cpu=True, step_in_backward=in_backward)
    model = NormedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data(40), batch_size=4))
    batches = iter(loader)
    for i in range(3):
        step(acc, model, optimizer, next(batches))
        if i == 2:
            acc.load_state(tmp_path / "async-0")  # the optimizer's moments are new tensors now
            step(acc, model, optimizer, next(batches))
        acc.save_state(tmp_path / f"sync-{i}")
        acc.save_state(tmp_path / f"async-{i}", async_save=True)
        stats, weight = model.norm.running_mean.clone(), model.head.weight.detach().clone()
        step(acc, model, optimizer, next(batches))  # at once: the copy has not started yet
        assert not torch.equal(model.norm.running_mean, stats) and not torch.equal(model.head.weight, weight)
        acc.wait_for_checkpoint()
        assert _files(tmp_path / f"async-{i}") == _files(tmp_path / f"sync-{i}")
        acc.load_state(tmp_path / f"sync-{i}")  # back to the state at the save before the next round
    acc.end_training()


def test_one_writer_thread_serves_every_save_and_ends_with_its_accelerator(tmp_path):
    def writers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "mixprec-save"}

    before = writers()
    acc, model, optimizer, loader = prepared()
    for i in range(3):
        acc.save_state(tmp_path / f"ckpt-{i}", async_save=True)
    acc.wait_for_checkpoint()
    (mine,) = writers() - before  # one thread for the three saves
    for i in range(3):
        verify_manifest(tmp_path / f"ckpt-{i}")
    acc.end_training()
    del acc, model, optimizer, loader
    gc.collect()  # a dropped Accelerator's writer (and its copy of the state) is freed, its thread ends
    mine.join(timeout=10)
    assert not mine.is_alive()


def test_an_accelerator_that_saved_asynchronously_still_pickles_and_its_copy_saves(tmp_path):
    acc = Accelerator(verbose=False, cpu=True)
    acc.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)]), 1))
    acc.save_state(tmp_path / "a", async_save=True)
    acc.wait_for_checkpoint()
    copy = pickle.loads(pickle.dumps(acc))  # accelerate's scripts copy the Accelerator; the writer's thread stays
    copy.save_state(tmp_path / "b", async_save=True)
    copy.wait_for_checkpoint()
    verify_manifest(tmp_path / "b")
    acc.end_training()


def test_a_scheduler_step_right_after_an_async_save_waits_for_its_copy(tmp_path, late_copy):
    # Planted: a learning rate held in a tensor, which torch's LR schedulers rewrite in place (fill_), stepped
    # the moment save_state returns while the writer's copy is 0.3 s late: the optimizer file must hold the
    # learning rate at the save, byte for byte what a synchronous save wrote.
    acc = Accelerator(verbose=False, cpu=True)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 0.5**n)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, DataLoader(data(), batch_size=4))
    step(acc, model, optimizer, next(iter(loader)))
    acc.save_state(tmp_path / "sync")
    acc.save_state(tmp_path / "async", async_save=True)
    lr = optimizer.param_groups[0]["lr"].clone()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] != lr  # rewritten in place, after the copy
    acc.wait_for_checkpoint()
    assert _files(tmp_path / "async") == _files(tmp_path / "sync")
    acc.end_training()
