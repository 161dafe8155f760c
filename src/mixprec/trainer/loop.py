"""The training loop: epochs of micro-batches, one optimizer step per ``gradient_accumulation_steps``.

Everything about precision, loss scaling, accumulation and processes is the Accelerator's: the loop calls
``accumulate``, ``backward``, ``clip_grad_norm_`` and the prepared optimizer and scheduler, and reads
``optimizer_step_was_skipped`` (host state, no sync). What the loop adds is the Trainer's bookkeeping:
global step, fractional epoch, data position, callbacks, and the record of skipped steps and loss-scale
changes.

Host syncs per optimizer step: the scaler's inf check (fp16 only) and nothing else, except on logging steps
(the loss window and the grad norm), on skipped steps (which parameters were non-finite), at most once a
second for the progress bar, and under several processes one tiny all-reduce for the SIGTERM agreement.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mixprec.scaling.scaler import ConsecutiveSkipsError
from mixprec.trainer.checkpointing import latest_checkpoint
from mixprec.trainer.data import DataPosition, count_samples, count_tokens
from mixprec.trainer.signals import GracefulStop

if TYPE_CHECKING:
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.trainer import Trainer

logger = logging.getLogger("mixprec.trainer")


@dataclass(frozen=True)
class Plan:
    """How long the run is, in micro-batches, optimizer steps and epochs."""

    batches_per_epoch: int
    steps_per_epoch: int
    max_steps: int
    num_epochs: int

    @classmethod
    def make(cls, batches_per_epoch: int, args: TrainingArguments) -> Plan:
        # The Accelerator steps on the last batch of an epoch even when it does not complete an
        # accumulation window, so an epoch has ceil(batches / accumulation) optimizer steps.
        steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
        if args.max_steps > 0:
            max_steps = args.max_steps
            num_epochs = math.ceil(max_steps / steps_per_epoch)
        else:
            max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
            num_epochs = math.ceil(args.num_train_epochs)
        return cls(batches_per_epoch, steps_per_epoch, max_steps, num_epochs)


def fp16_overflow(report: Any) -> dict[str, str]:
    """The candidates a diagnosis rules out for "auto": fp16 where it saw a non-finite value under fp16."""
    event = getattr(report, "nonfinite_checks", {}).get("fp16") if report is not None else None
    if event is None:
        return {}
    return {"fp16": f"the diagnosis saw fp16 overflow ({event.phase} of {event.module}, {event.what})"}


class TrainingLoop:
    """One ``Trainer.train()`` run from ``start`` to the plan's end (or a stop)."""

    def __init__(self, trainer: Trainer, loader: Any, plan: Plan, start: DataPosition) -> None:
        self.t = trainer
        self.loader = loader
        self.plan = plan
        self.position = start
        self.interrupted: int | None = None  # the signal that stopped the run
        self._micro_in_step = 0
        self._grad_norm: torch.Tensor | None = None
        self._scaling = False
        self._last_scale: float | None = None

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        t, plan = self.t, self.plan
        acc = t.accelerator
        reduce_max = None
        if acc.num_processes > 1:
            reduce_max = lambda flag: bool(acc.reduce(int(flag), reduction="max").item())  # noqa: E731
        t.event("on_train_begin")
        t.meter.start()
        if not acc.precision_pending:  # a named precision, or "auto" kept from the checkpoint
            self._start_scaling()
        with GracefulStop() as stop:
            for epoch in range(self.position.epoch, plan.num_epochs):
                micro = self.position.batches_consumed if epoch == self.position.epoch else 0
                t.control._new_epoch()
                t.event("on_epoch_begin")
                # Resumed from a checkpoint taken at an epoch's last step, before that epoch's end (its
                # evaluation, its save): nothing is left to read (the loader resumes at the next epoch), but
                # the epoch's end still has to happen, as it did in the uninterrupted run.
                batches = self.loader if micro < plan.batches_per_epoch else ()
                for batch in batches:
                    micro += 1
                    stepped = self._micro_batch(batch)
                    if not stepped:
                        t.event("on_substep_end")
                        continue
                    t.state.global_step += 1
                    t.state.epoch = epoch + micro / plan.batches_per_epoch
                    self.position = DataPosition(epoch, micro)
                    t.event("on_step_end", meter=t.meter)
                    # a signal during the last step changes nothing: the run ends as a complete one
                    if stop.agreed(reduce_max) and t.state.global_step < plan.max_steps:
                        self._stop_for_signal(stop.received)
                    t.maybe_log_save_evaluate(self._grad_norm, self.position)
                    if t.control.should_epoch_stop or t.control.should_training_stop:
                        break
                if self.interrupted is not None:
                    return
                if micro >= plan.batches_per_epoch:  # the epoch ran to its end
                    self.position = DataPosition(epoch + 1, 0)
                    t.state.epoch = float(epoch + 1)
                t.event("on_epoch_end")
                t.maybe_log_save_evaluate(self._grad_norm, self.position)
                if t.control.should_training_stop:
                    return

    def _stop_for_signal(self, signum: int | None) -> None:
        self.interrupted = signum or 15
        control = self.t.control
        control.should_save = True
        control.should_training_stop = True
        logger.warning(
            "signal %s received: saving a checkpoint at step %d and stopping", signum, self.t.state.global_step
        )

    def _micro_batch(self, batch: Any) -> bool:
        """Forward, backward and (on the last micro-batch of a step) the optimizer step. Returns whether the
        optimizer stepped."""
        t, acc = self.t, self.t.accelerator
        if self._micro_in_step == 0:
            t.control._new_step()
            t.event("on_step_begin")
        self._micro_in_step += 1
        if acc.precision_pending:
            self._settle_precision(batch)
        with acc.accumulate(t.model):
            loss = t.compute_loss(t.model, batch)
            acc.backward(loss)
            t.meter.add(loss, count_samples(batch), count_tokens(batch))
            if not acc.sync_gradients:
                return False
            self._optimizer_step()
        self._micro_in_step = 0
        return True

    def _settle_precision(self, batch: Any) -> None:
        """precision="auto": race the candidate modes on this first batch through the Trainer's own
        ``compute_loss`` (nothing of it reaches training), log the measurement, then train in the winner."""
        t, acc = self.t, self.t.accelerator
        excluded = fp16_overflow(t.diagnosis)
        decision = acc.settle_precision(lambda: t.compute_loss(t.model, batch), batch, excluded=excluded)
        if decision is not None:
            t.record_event("auto_precision", t.state.global_step, **decision.to_dict())
            logger.info("%s", decision.explain())
        self._start_scaling()

    def _start_scaling(self) -> None:
        """Read the (decided) precision's scaler: whether it scales, and the scale to log changes from."""
        scaler = self.t.accelerator.scaler
        self._scaling = scaler.is_enabled()
        self._last_scale = scaler.get_scale() if self._scaling else None
        if self._scaling:
            self.t.record_event("loss_scale", self.t.state.global_step, scale=self._last_scale)

    def _optimizer_step(self) -> None:
        t, acc, args = self.t, self.t.accelerator, self.t.args
        if args.max_grad_norm:
            self._grad_norm = acc.clip_grad_norm_(t.model.parameters(), args.max_grad_norm)
        t.event("on_pre_optimizer_step")
        scale_used = self._last_scale
        try:
            t.optimizer.step()
        except ConsecutiveSkipsError as err:
            raise self._skips_error(err) from err
        skipped = acc.optimizer_step_was_skipped
        if skipped:
            self._record_skip(scale_used)
        t.event("on_optimizer_step", skipped=skipped)
        t.lr_scheduler.step()  # the prepared scheduler holds still after a skipped step
        t.optimizer.zero_grad()
        if self._scaling:
            scale = acc.scaler.get_scale()  # a host mirror: no sync
            if scale != self._last_scale:
                self._last_scale = scale
                t.record_event("loss_scale", t.state.global_step + 1, scale=scale)

    def _record_skip(self, scale_used: float | None) -> None:
        """Log which parameters held non-finite gradients. One host sync, on skipped steps only, before
        zero_grad clears the evidence."""
        t = self.t
        names = t.accelerator.scaler.nonfinite_grad_names(t.optimizer.optimizer)
        step = t.state.global_step + 1
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        logger.warning(
            "step %d: optimizer step skipped (loss scale %g): non-finite gradients in %s",
            step,
            scale_used or 0.0,
            shown or "no parameter (a gradient hook or another process?)",
        )
        t.record_event("skipped_step", step, loss_scale=scale_used, nonfinite_grads=names)

    def _skips_error(self, err: ConsecutiveSkipsError) -> ConsecutiveSkipsError:
        t = self.t
        last = latest_checkpoint(t.args.output_dir)
        message = (
            f"Trainer stopped at step {t.state.global_step + 1} (epoch {t.state.epoch or 0.0:.2f}, precision "
            f"{t.accelerator.mixed_precision}): {err} Nothing was saved from this state; the last complete "
            f"checkpoint is {last if last else 'none'}."
        )
        watch = getattr(t.accelerator, "watch", None)
        if watch is not None and watch.skip_counts:  # the precision watch traced earlier skips to modules
            traced = ", ".join(f"{name} ({n} skips)" for name, n in watch.skip_counts.most_common(3))
            message += f" The precision watch traced the skipped steps to: {traced}."
        t.record_event("stopped", t.state.global_step + 1, reason=message)
        t.close_progress()
        return ConsecutiveSkipsError(message)
