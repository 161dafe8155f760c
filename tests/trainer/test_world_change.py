"""A run resumed with another number of processes than it saved with keeps its steps and LR schedule
(docs/guides/distributed.md, "Several nodes"): an epoch-sized run counted its steps again at the new world
size, so resumed by more processes it had "nothing to train" (its last epoch lost), and by fewer it ran twice
the steps on a cosine that never ended. The torchrun tests launch trainer_world_script.py (gloo, CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from mixprec import TrainingArguments
from mixprec.loaders.from_datasets import DataPosition
from mixprec.loaders.sharding import ShardedBatchSampler
from mixprec.trainer.loop import Plan
from mixprec.trainer.world_change import SavedRun, planned, reaching

SCRIPT = Path(__file__).with_name("trainer_world_script.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, processes: int, checkpoint: Path | None = None) -> tuple[str, list[dict]]:
    """The script alone (1 process) or under torchrun; its output and each rank's report."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    cmd = [sys.executable]
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--master_port={port}"]
    cmd += [str(SCRIPT), str(out), *([str(checkpoint)] if checkpoint else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr, [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize(("saved_by", "resumed_by"), [(1, 2), (2, 1)])
def test_a_resume_at_another_world_size_keeps_the_runs_steps_and_schedule(tmp_path, saved_by, resumed_by):
    # 48 examples of batch 4: 12 steps an epoch for 1 process, 6 for 2; 2 epochs. Resumed from checkpoint-5 or
    # -20, mid-epoch (its position moves to the new split; batch 8 of 12 was refused by 2 processes as data that
    # changed): it ends at the saved run's step count, its cosine at the uninterrupted run's last learning rate
    whole = _launch(tmp_path / "whole", saved_by)[1][0]
    step = 20 if saved_by == 1 else 5
    said, reports = _launch(tmp_path / "resumed", resumed_by, tmp_path / "whole" / "run" / f"checkpoint-{step}")
    assert whole["max_steps"] == whole["global_step"] == 24 // saved_by
    saved = "1 process" if saved_by == 1 else "2 processes"
    assert f"checkpoint-{step} was saved by {saved} and resumes with {resumed_by}: the run keeps its step" in said
    # the resumed run's checkpoints say which world size counted its steps: a second resume keeps them too
    later = max((tmp_path / "resumed" / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert json.loads((later / "trainer_extra.json").read_text())["sized_by"] == saved_by
    for report in reports:
        assert report["world_size"] == resumed_by and report["first_step"] == step
        assert report["max_steps"] == report["global_step"] == whole["max_steps"]  # every step trained
        last = str(whole["max_steps"])
        assert report["lrs"][last] == whole["lrs"][last]  # the schedule as saved: it ends where it would have
        # the data position, moved to the batch its samples complete in the new split (no sample skipped): 1 -> 2,
        # epoch 1 batch 8 of 12 is batch 4 of 6, 4 steps to go; 2 -> 1, epoch 0 batch 5 of 6 is 10 of 12, 7 to go
        assert report["epoch"] == pytest.approx(2 + 2 / 6 if resumed_by == 2 else 1 + 5 / 12)


def test_an_epoch_sized_plan_keeps_the_saved_steps_and_a_step_sized_one_its_own(tmp_path):
    plan = Plan(batches_per_epoch=12, steps_per_epoch=12, max_steps=24, num_epochs=2)  # 1 process, 2 epochs
    saved = SavedRun(num_processes=2, sized_by=2, max_steps=12, num_train_epochs=2.0, sized_in_steps=False)
    epochs = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=2)
    assert planned(plan, saved, epochs, num_processes=1).max_steps == 12
    assert planned(plan, saved, epochs, num_processes=2) is plan  # the same world size: HF's plan, unchanged
    more = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=3)  # resumed for one epoch more
    assert planned(plan, saved, more, num_processes=1).max_steps == 18
    steps = TrainingArguments(output_dir=str(tmp_path), max_steps=24)
    assert planned(plan, saved, steps, num_processes=1) is plan
    # and again: the run's next checkpoint, saved by 1 process, still counts the 2 processes' steps
    kept = planned(plan, saved, epochs, num_processes=1)
    again = SavedRun(num_processes=1, sized_by=kept.sized_by, max_steps=12, num_train_epochs=2.0, sized_in_steps=False)
    assert kept.sized_by == 2 and planned(plan, again, epochs, num_processes=1).max_steps == 12
    assert planned(kept, again, epochs, num_processes=2) is kept  # back at the size that counted them
    # two saved steps' worth of epochs at 2 processes: epoch 1, batch 5 of 6 -> 10 of 12 here; 7 steps left
    later = Plan(batches_per_epoch=12, steps_per_epoch=12, max_steps=12, num_epochs=1)
    assert reaching(later, DataPosition(1, 10), 5, accumulation=1).num_epochs == 3
    assert reaching(plan, DataPosition(1, 0), 12, accumulation=1) is plan


def test_a_position_of_another_world_size_maps_to_the_batch_its_samples_complete():
    two = ShardedBatchSampler(48, 4, num_processes=2)  # 6 batches of 8 samples
    one = ShardedBatchSampler(48, 4)  # 12 of 4
    assert one.batches_at(5, num_processes=2) == 10 and two.batches_at(3, num_processes=1) == 1  # 12 of 16 read
    assert two.batches_at(12, num_processes=1) == 6 and one.batches_at(0, num_processes=2) == 0
