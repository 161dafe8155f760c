"""auto's in-run race, rewound: once it decides, the Trainer takes the race's steps again in the chosen mode.

The in-run race (mixprec.precision.inrun) trains the run's first steps each in the candidate mode the race
times next; a short job's final loss moves by whole percents with such early differences (issue 34: the main
job's 10 seeds ended 0.5% from their race aside at the median, 5% at worst). The Trainer holds what the race
cannot, the batches. So when the race begins, :class:`RaceRewind` snapshots what a training step changes
(trainable parameters and buffers, optimizer state and param groups, the LR schedule, every candidate's loss
scaler and step record, every RNG), and keeps each race micro-batch as the loader gave it; when the race
decides, :meth:`RaceRewind.replay` puts the snapshot back and trains those micro-batches again as ordinary steps
of the chosen mode (:func:`replay_micro_batch`: the loop's step without its events). From then on the run is
bit-identical to one that named the chosen mode: its weights, moments, schedule, loss scale, skipped steps and
RNG are that run's. What stays the race's: the losses, grad norms and skipped-step events already logged for
those steps (each skip event says ``race_step``), the precision watch's samples, traces and capsules of them (it
is paused during the replay), the step count, samples and tokens (the steps are not counted twice), and anything
a callback did at them (a ``training_step`` override runs again for each replayed micro-batch). The default flow
neither evaluates nor saves among them: the race ends before the run's first evaluation or save
(``callbacks.steps_to_first_look``), or races aside where it cannot; under ``MIXPREC_AUTO_RACE=in-run`` an
evaluation at a race step measures the race's model. The decision says what was replayed and what it cost
(``replayed_steps``, ``replay_seconds``, within ``cost_seconds``).

Costs: one copy of the trainable parameters, buffers and optimizer state in CPU memory while the race runs (a GPU run
does not double its device memory; the copy and the restore are one device-host transfer each), the race's
micro-batches held as the loader gave them (on the device), and the race's steps once more in the chosen
mode: with fp32, bf16 and fp16 racing, ~16 steps. Two host syncs to time the replay.

Where it does not apply: a race still undecided when an epoch ends (the next epoch's loader order draws from
the RNG, which a rewind would move) or when the run stops; a checkpoint saved during the race (a callback's, or
under ``MIXPREC_AUTO_RACE=in-run``), whose resumed run races again from there; a race of more than
``REPLAY_SHARE`` of a short run's steps (:meth:`RaceRewind.pays`); a hand-written Accelerator loop, whose batches
mixprec never holds: there the race's steps stay as they ran (``MIXPREC_AUTO_RACE=aside`` gives a run
bit-identical to the chosen mode's anywhere).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.checkpoint.rng import rng_snapshot, set_rng_state
from mixprec.precision.auto import AutoPrecision
from mixprec.precision.trial import synchronize
from mixprec.shards import local
from mixprec.tree import tree_map

if TYPE_CHECKING:
    from mixprec.trainer.context import RunContext

logger = logging.getLogger("mixprec.trainer")


REPLAY_SHARE = 0.1
"""The most of a run the replay may take: a race of more optimizer steps than this share of the run's keeps its
steps as they ran, for on a run that short replaying them costs more than the race saves (issue 36's 60-step
Trainer example went from 1.02x bf16's time to 1.20x with its 10 race steps replayed). The default job's race is
4-6% of its 200-300 steps. ``MIXPREC_AUTO_REPLAY=all`` replays whatever the share."""


class _Kept:
    """A live tensor and a CPU copy of its value; :meth:`put_back` writes the copy into it, in place (so
    whatever holds the tensor, a fused optimizer's LR or an FSDP2 shard, sees the old value)."""

    def __init__(self, live: torch.Tensor) -> None:
        self.live = live
        self.saved = local(live).detach().to("cpu", copy=True)

    def put_back(self) -> torch.Tensor:
        with torch.no_grad():
            local(self.live).copy_(self.saved)
        return self.live


def _keep(value: Any) -> Any:
    return _Kept(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _put_back(value: Any) -> Any:
    return value.put_back() if isinstance(value, _Kept) else copy.deepcopy(value)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


class RaceRewind:
    """The run as the in-run race found it (:meth:`take`), the race's micro-batches (:meth:`keep`), and the
    replay of them in the chosen mode (:meth:`replay`)."""

    def __init__(self, run: RunContext, auto: AutoPrecision) -> None:
        acc = run.accelerator
        self._auto = auto
        auto.announcement_held = True  # its line, once decided, says the replay's cost too (release_announcement)
        # a frozen parameter (LoRA's base weights) is no step's to change: only the trainable ones are copied
        trainable = [p for p in run.model.parameters() if p.requires_grad]
        self._tensors = [_Kept(t) for t in _unique([*trainable, *run.model.buffers()])]
        optimizer = run.optimizer.optimizer  # the precision's conversion of the user's: the one that steps
        self._optimizer = optimizer
        self._state = {p: {k: _keep(v) for k, v in s.items()} for p, s in optimizer.state.items()}
        self._groups = [{k: _keep(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._schedule = copy.deepcopy(run.lr_scheduler.state_dict())
        # every candidate's scaler and step record: the chosen one starts over from here (a disabled scaler
        # loads no state, but its record counts the steps and skips the summary reports)
        self._scalers = {
            p.name: (copy.deepcopy(p.scaler.state_dict()), p.scaler.record.state_dict()) for p in auto.options()
        }
        self._rng = rng_snapshot()
        self._device = acc.device
        self.batches: list[tuple[Any, bool, Any]] = []

    @classmethod
    def take(cls, run: RunContext) -> RaceRewind | None:
        """A rewind to here, where "auto" has just begun racing as the run's steps; None when it is not (a named
        precision, a decision made aside or kept from a checkpoint). Copies the state to the CPU: one transfer."""
        precision = run.accelerator.precision
        if not isinstance(precision, AutoPrecision) or not run.accelerator.precision_racing:
            return None
        return cls(run, precision)

    def keep(self, batch: Any, end_of_dataloader: bool, items: Any = None) -> None:
        """A race micro-batch, as the loader gave it (its containers copied: a loss that pops a key from the
        dict it is given still finds it in the replay), whether it was the loader's last, and its window's
        label tokens (loss_items.py)."""
        self.batches.append((tree_map(lambda leaf: leaf, batch), end_of_dataloader, items))

    def _restore(self, run: RunContext) -> None:
        run.accelerator.checkpoints.fence()  # an asynchronous save may still be copying the live weights
        for kept in self._tensors:
            kept.put_back()
        self._optimizer.state.clear()
        for p, saved in self._state.items():
            self._optimizer.state[p] = {k: _put_back(v) for k, v in saved.items()}
        for group, saved_group in zip(self._optimizer.param_groups, self._groups):
            group.update({k: _put_back(v) for k, v in saved_group.items()})
        run.lr_scheduler.load_state_dict(copy.deepcopy(self._schedule))
        chosen = run.accelerator.precision
        scaler, record = self._scalers[chosen.name]
        chosen.scaler.load_state_dict(copy.deepcopy(scaler))
        chosen.scaler.record.load_state_dict(record)
        set_rng_state(self._rng())

    @staticmethod
    def drop(rewind: RaceRewind | None) -> None:
        """A race still running when its epoch or its run ends: its steps stay as they ran (said once)."""
        if rewind is not None:
            logger.warning("auto: the epoch or the run ended before the race decided: its steps stay as they ran")
            rewind._auto.release_announcement()

    def pays(self, run_steps: int, accumulation: int) -> bool:
        """Whether replaying the race's steps fits in ``REPLAY_SHARE`` of a run of ``run_steps`` optimizer steps
        (``accumulation`` micro-batches each); when it does not, says so (info) and the steps stay as they ran."""
        steps = len(self.batches) / max(1, accumulation)
        if os.environ.get("MIXPREC_AUTO_REPLAY", "") == "all" or steps <= REPLAY_SHARE * run_steps:
            return True
        self._auto.release_announcement()  # decided, and nothing to replay: its line as it stands
        logger.info(
            "auto: the race's %d steps stay as they ran: replaying them would cost %.0f%% of this %d-step run "
            "(more than %.0f%%; MIXPREC_AUTO_REPLAY=all replays anyway)",
            round(steps),
            100 * steps / max(1, run_steps),
            run_steps,
            100 * REPLAY_SHARE,
        )
        return False

    def replay(self, run: RunContext) -> tuple[int, float]:
        """The race has decided: put the run back as the race found it and train the race's micro-batches again in
        the chosen mode. Returns the optimizer steps replayed and their wall seconds (two device syncs), which
        the decision records."""
        acc = run.accelerator
        synchronize(self._device)
        start = time.perf_counter()
        self._restore(run)
        state = acc.gradient_state
        end_of_dataloader, steps = state.end_of_dataloader, 0
        watch = acc.watch.paused() if acc.watch is not None else contextlib.nullcontext()
        try:
            with watch:  # it followed these steps once, as the race ran them
                for batch, last, items in self.batches:
                    state.end_of_dataloader = last  # the same accumulation windows as the race's steps
                    steps += replay_micro_batch(run, batch, items)
        finally:
            state.end_of_dataloader = end_of_dataloader
        synchronize(self._device)
        seconds = time.perf_counter() - start
        self._auto.note_replay(steps, seconds)
        self._auto.release_announcement()
        return steps, seconds


def replay_micro_batch(run: RunContext, batch: Any, items: Any = None) -> bool:
    """One micro-batch as the loop trains it (loop.py's ``_micro_batch`` and ``_optimizer_step``: forward and
    backward, and on the window's last micro-batch clipping, the optimizer step, the schedule, zero_grad),
    without its events, logging and counters. Returns whether the optimizer stepped. A change to the loop's
    step must land here too: tests/trainer/test_race_rewind.py holds the two to the same weights."""
    acc = run.accelerator
    with acc.accumulate(run.model):
        run.training_step(run.model, batch, *([] if items is None else [items]))
        if not acc.sync_gradients:
            return False
        if run.args.max_grad_norm:
            acc.clip_grad_norm_(run.model.parameters(), run.args.max_grad_norm)
        run.optimizer.step()
        run.lr_scheduler.step()
        run.optimizer.zero_grad()
    return True
