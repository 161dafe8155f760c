"""A resume with another number of processes than the checkpoint was saved by (an elastic job that lost or
gained a node, or a run moved to other hardware): docs/guides/distributed.md, "Several nodes".

What the run keeps exactly: the weights, the optimizer, the loss scale (the checkpoint's), its total of
optimizer steps and so its learning-rate schedule. A run sized in epochs counts its steps at the world size it
was started with: ``max_steps`` comes from the checkpoint, not from the epochs at the new world size (where a
step reads another number of samples), so the cosine still ends where it would have, and a run saved by one
process and resumed by two still trains its last steps. What it cannot keep: the tokens per step (a step
reads one batch per process) and the exact data position, which is mapped to the new split of the epoch (no
sample skipped, at most one global batch read again); the run ends at its step count, so an epoch-sized run
sees more or fewer epochs of data than it would have. One log line says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mixprec.checkpoint import load_json
from mixprec.checkpoint.folder_checks import META
from mixprec.checkpoint.folders import TRAINER_ARGS, TRAINER_EXTRA, TRAINER_STATE
from mixprec.loaders.from_datasets import DataPosition
from mixprec.loaders.sharding import ShardedBatchSampler

if TYPE_CHECKING:
    from mixprec.trainer.args import TrainingArguments


class _Length(Protocol):
    steps_per_epoch: int
    max_steps: int
    num_epochs: int
    sized_by: int


Plan = TypeVar("Plan", bound=_Length)  # loop.py's Plan (which imports this module, through checkpointing.py)

logger = logging.getLogger("mixprec.trainer")


@dataclass(frozen=True)
class SavedRun:
    """The length of the run a checkpoint belongs to, and the world size that saved it."""

    num_processes: int
    sized_by: int
    """The number of processes whose epochs counted ``max_steps``: the saver's, or, after a resume at another
    world size, the run's first (a second resume at the new size keeps the steps too)."""
    max_steps: int
    num_train_epochs: float | None
    """The saved arguments' (None where they cannot be read)."""
    sized_in_steps: bool
    """The saved arguments asked for ``max_steps`` (not epochs)."""

    @classmethod
    def read(cls, checkpoint: Path) -> SavedRun | None:
        """From the checkpoint's files; None where they cannot be read (loading it then says what is wrong)."""
        try:
            meta, state = load_json(checkpoint / META), load_json(checkpoint / f"{TRAINER_STATE}.json")
            processes, max_steps = int(meta["num_processes"]), int(state["max_steps"])
            sized_by = int(load_json(checkpoint / f"{TRAINER_EXTRA}.json").get("sized_by") or processes)
        except Exception:  # noqa: BLE001 - a damaged or foreign folder: load_trainer_checkpoint names the problem
            return None
        try:
            saved_args = load_json(checkpoint / f"{TRAINER_ARGS}.json")
            epochs, sized_in_steps = float(saved_args["num_train_epochs"]), int(saved_args["max_steps"]) > 0
        except Exception:  # noqa: BLE001 - the arguments are a record for people: without them, the same epochs
            epochs, sized_in_steps = None, False
        return cls(processes, sized_by, max_steps, epochs, sized_in_steps)


def planned(plan: Plan, saved: SavedRun | None, args: TrainingArguments, num_processes: int) -> Plan:
    """The plan of a run resumed from a checkpoint ``saved`` by another number of processes: an epoch-sized run
    keeps the saved total of optimizer steps (scaled where the epochs asked for changed too). A run sized in
    steps (``max_steps``), a stream and a resume at the same world size keep the plan they have (HF's)."""
    if saved is None or saved.sized_by == num_processes or args.max_steps > 0 or saved.sized_in_steps:
        return plan
    max_steps = saved.max_steps
    if saved.num_train_epochs and args.num_train_epochs != saved.num_train_epochs:  # resumed for more (or fewer)
        max_steps = math.ceil(saved.max_steps * args.num_train_epochs / saved.num_train_epochs)
    num_epochs = max(plan.num_epochs, math.ceil(max_steps / plan.steps_per_epoch))
    return dataclasses.replace(plan, max_steps=max_steps, num_epochs=num_epochs, sized_by=saved.sized_by)


def reaching(plan: Plan, start: DataPosition, global_step: int, accumulation: int) -> Plan:
    """``plan`` with enough epochs to take its steps from ``start`` (a position mapped from another world size
    may lie further into the epochs than ``global_step`` steps of this one would); otherwise unchanged."""
    done_in_epoch = math.ceil(start.batches_consumed / accumulation)
    left = max(0, plan.max_steps - global_step)
    needed = start.epoch + math.ceil((left + done_in_epoch) / plan.steps_per_epoch)
    return plan if needed <= plan.num_epochs else dataclasses.replace(plan, num_epochs=needed)


def rescaled(position: DataPosition, loader: Any, saved_processes: int, num_processes: int) -> DataPosition:
    """``position`` (in batches of ``saved_processes``' split) in the batches of this world size; the prepared
    loader is set to the same place."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, ShardedBatchSampler):  # mixprec's split: counted in samples, exactly
        batches = sampler.batches_at(position.batches_consumed, saved_processes)
    else:  # a stream or a loader of the user's: in proportion (a stream's batches are the processes' together)
        batches = position.batches_consumed * saved_processes // num_processes
        with contextlib.suppress(TypeError):  # a stream has no length, and no end to reach
            batches = min(batches, len(loader))
    moved = DataPosition(position.epoch, batches)
    state = loader.state_dict() if hasattr(loader, "state_dict") else None
    if state is not None:  # the loader's convention: an epoch read to its end is the next one's start
        done = batches >= len(loader)
        loader.load_state_dict({**state, "epoch": moved.epoch + done, "batches": 0 if done else batches})
    return moved


def explain(path: Path, saved: tuple[int, DataPosition], now: tuple[int, DataPosition], steps: tuple[int, int]) -> str:
    """The one line a resume at another world size logs: what it keeps and what it cannot. ``saved`` and
    ``now``: the number of processes and the data position, there and here; ``steps``: done, and in all."""
    (before, there), (after, here), (step, max_steps) = saved, now, steps
    return (
        f"{path.name} was saved by {_processes(before)} and resumes with {after}: the run keeps its step count "
        f"(step {step} of {max_steps}) and learning-rate schedule, with its weights, optimizer and loss scale; it "
        f"cannot keep the tokens per step (a step now reads the batches of {_processes(after)}, not {before}) "
        f"nor the exact data position (batch {there.batches_consumed} of epoch {there.epoch} there is batch "
        f"{here.batches_consumed} here: no sample skipped, at most one global batch read again)"
    )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"
