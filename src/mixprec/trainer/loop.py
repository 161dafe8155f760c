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

import contextlib
import logging
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mixprec.loaders.from_datasets import DataPosition, is_stream
from mixprec.scaling.record import ConsecutiveSkipsError
from mixprec.trainer import checkpointing as ckpt  # by module: tests wrap save_trainer_checkpoint
from mixprec.trainer import loss_items, weights, world_change
from mixprec.trainer.batches import count_samples, count_tokens, input_tokens_seen
from mixprec.trainer.callbacks import export_callback_states, steps_to_first_look
from mixprec.trainer.compile_gate import CompileGate
from mixprec.trainer.hf_loggers import hf_logger
from mixprec.trainer.neftune import neftune
from mixprec.trainer.phase_clock import UNSPLIT
from mixprec.trainer.race_rewind import RaceRewind
from mixprec.trainer.signals import GracefulStop, TrainingInterrupted
from mixprec.trainer.summary import finish_run

if TYPE_CHECKING:
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.context import RunContext
    from mixprec.trainer.state import TrainerState, TrainOutput

logger = logging.getLogger("mixprec.trainer")


@dataclass(frozen=True)
class Plan:
    """How long the run is, in micro-batches, optimizer steps and epochs."""

    batches_per_epoch: int
    steps_per_epoch: int
    max_steps: int
    num_epochs: int
    sized_by: int = 0
    """The number of processes whose epochs counted ``max_steps`` (0: this run's; world_change.py)."""

    @classmethod
    def for_dataset(cls, dataset: Any, loader: Any, args: TrainingArguments) -> Plan:
        """The run's length. A stream has no length: max_steps is required (as in HF), and an exhausted stream
        is read again from its start, as the next epoch, until max_steps."""
        if is_stream(dataset):
            if args.max_steps <= 0:
                raise ValueError(
                    "TrainingArguments(max_steps=-1): train_dataset is a stream with no length, so the number of "
                    "steps cannot come from num_train_epochs; set max_steps > 0"
                )
            return cls(args.max_steps * args.gradient_accumulation_steps, args.max_steps, args.max_steps, sys.maxsize)
        # The Accelerator steps on the last batch of an epoch even when it does not complete an
        # accumulation window, so an epoch has ceil(batches / accumulation) optimizer steps.
        steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
        if args.max_steps > 0:
            max_steps = args.max_steps
            num_epochs = math.ceil(max_steps / steps_per_epoch)
        else:
            max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
            num_epochs = math.ceil(args.num_train_epochs)
        return cls(len(loader), steps_per_epoch, max_steps, num_epochs)

    def banner(self, args: TrainingArguments, num_examples: int | None, trainable_params: int) -> str:
        """HF's "***** Running training *****" block, which scripts and tests look for in transformers' log."""
        lines = ["***** Running training *****"]
        if num_examples is not None:
            lines.append(f"  Num examples = {num_examples:,}")
        lines += [
            f"  Num Epochs = {self.num_epochs:,}",
            f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}",
            f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}",
            f"  Total optimization steps = {self.max_steps:,}",
            f"  Number of trainable parameters = {trainable_params:,}",
        ]
        return "\n".join(lines)

    def apply_to(self, state: TrainerState, args: TrainingArguments) -> None:
        """This run's plan into the state, also over a loaded one (a resume may train longer than the run it
        continues)."""
        state.max_steps = self.max_steps
        state.num_train_epochs = self.num_epochs
        state.train_batch_size = args.per_device_train_batch_size
        state.compute_steps(args, self.max_steps)
        state.epoch = 0.0 if state.epoch is None else state.epoch  # HF's: an evaluation on start logs epoch 0


def overflowed_formats(report: Any) -> dict[str, str]:
    """The formats a diagnosis saw a non-finite value under (a format's name -> what it saw): a precision still to
    be decided leaves out every mode computing in one (``unsafe_formats``)."""
    checks = getattr(report, "nonfinite_checks", {}) if report is not None else {}
    return {
        fmt: f"the diagnosis saw {fmt} overflow ({event.phase} of {event.module}, {event.what})"
        for fmt, event in checks.items()
        if event is not None
    }


def fit(run: RunContext, plan: Plan, checkpoint: Any, train_stream: Any, examples: int | None) -> TrainOutput:
    """One prepared run from its start (or ``checkpoint``) to its output: the resume, the loop, the last save
    landed, the best model loaded (``load_best_model_at_end``), the summary. After a stop by signal, raises
    :class:`~mixprec.trainer.signals.TrainingInterrupted` naming the checkpoint it saved."""
    acc, args = run.accelerator, run.args
    start = DataPosition()
    if checkpoint is not None:
        start = ckpt.resume_run(run, checkpoint, train_stream, plan.max_steps)
        plan = world_change.reaching(plan, start, run.state.global_step, args.gradient_accumulation_steps)
    plan.apply_to(run.state, args)
    run.sized_by = plan.sized_by or acc.num_processes  # saved with each checkpoint: a later resume keeps it
    model = run.model
    model.train()
    if args.eval_on_start and checkpoint is None:
        run.evaluate()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hf_logger("trainer").info("%s", plan.banner(args, examples, trainable))
    loop = TrainingLoop(run, plan, start)
    steps_before = run.state.global_step
    try:
        with neftune(acc.unwrap_model(model), args.neftune_noise_alpha):  # embedding noise while training only
            loop.run()
    except BaseException:
        # a run that fails after a save returned still lands that save (async_save): the checkpoint it
        # announced is there to resume from. One process only: elsewhere the wait is a collective that the
        # other processes may never reach (a process that exits lands its save at exit)
        if acc.num_processes == 1:
            with contextlib.suppress(Exception):
                acc.wait_for_checkpoint()
        raise
    ckpt.wait_for_checkpoint(run, ended=loop.interrupted is None)  # async_save: it lands before it is read
    if loop.interrupted is None and args.load_best_model_at_end:
        weights.load_best_model(acc, model, args, run.state)
    output = finish_run(run, steps_before, loop.compile.summary(plan.max_steps - run.state.global_step))
    if loop.interrupted is not None:
        last = ckpt.latest_checkpoint(args.output_dir)
        stop = TrainingInterrupted(
            loop.interrupted, run.state.global_step, str(last) if last else None, run.resume_command
        )
        acc.print(f"mixprec: {stop}", file=sys.stderr)
        raise stop
    return output


class TrainingLoop:
    """One ``Trainer.train()`` run from ``start`` to the plan's end (or a stop): the steps, and the logging,
    evaluation and checkpoints the callbacks' control asks for between them."""

    def __init__(self, run: RunContext, plan: Plan, start: DataPosition) -> None:
        self.run_ctx = run
        self.plan = plan
        self.position = start
        self.interrupted: int | None = None  # the signal that stopped the run
        self._micro_in_step = 0
        self._grad_norm: torch.Tensor | None = None
        self._scaling = False
        self._last_scale: float | None = None
        self._undecided = False  # decided on the steps themselves ("auto"): logged at the step that decides it
        self.compile = CompileGate(run)  # torch_compile, measured on these steps; under "auto" kept where it pays
        self._rewind: RaceRewind | None = None  # that race's steps, replayed in the chosen mode once it decides
        model = run.accelerator.unwrap_model(run.model)
        self._main_input = getattr(model, "main_input_name", "input_ids")  # HF's, for the token count

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        ctx, plan = self.run_ctx, self.plan
        acc, events = ctx.accelerator, ctx.events
        several = acc.num_processes > 1
        reduce_max = (lambda flag: bool(acc.reduce(int(flag), reduction="max").item())) if several else None
        events.fire("on_train_begin")
        ctx.meter.start()
        if ctx.state.global_step >= plan.max_steps:
            return  # resumed at or past the run's end: not one more step (finish_run says so)
        if not acc.precision_pending:  # a named precision, or "auto" kept from the checkpoint
            self._start_scaling()
        with GracefulStop() as stop:
            for epoch in range(self.position.epoch, plan.num_epochs):
                micro = self.position.batches_consumed if epoch == self.position.epoch else 0
                ctx.control.new_epoch()
                events.fire("on_epoch_begin")
                # Resumed from a checkpoint taken at an epoch's last step, before that epoch's end (its evaluation,
                # its save): nothing is left to read (the loader resumes at the next epoch), but the epoch's end
                # still has to happen, as it did in the uninterrupted run. Items: loss_items.py
                batches = ctx.train_loader if micro < plan.batches_per_epoch else ()
                fresh = micro == 0
                for batch, items in loss_items.windows(batches, ctx.count_items, acc.gradient_state):
                    ctx.meter.phases.lap("data")  # the loader's next batch (and the device copy it makes)
                    micro += 1
                    stepped = self._micro_batch(batch, items)
                    if not stepped:
                        events.fire("on_substep_end")
                        ctx.meter.phases.lap("callbacks_logging")
                        continue
                    ctx.state.global_step += 1
                    ctx.state.epoch = epoch + micro / plan.batches_per_epoch
                    self.position = DataPosition(epoch, micro)
                    events.fire("on_step_end", meter=ctx.meter)
                    # a signal during the last step changes nothing: the run ends as a complete one
                    if stop.agreed(reduce_max) and ctx.state.global_step < plan.max_steps:
                        self._stop_for_signal(stop.received)
                    self._log_save_evaluate()
                    if ctx.control.should_epoch_stop or ctx.control.should_training_stop:
                        break
                if self.interrupted is not None:
                    return
                if fresh and micro == 0:  # every pass would be empty: a stream's epochs have no end to reach
                    raise ValueError(f"Trainer.train(): train_dataset gave no batch in a whole pass (epoch {epoch})")
                self._rewind = RaceRewind.drop(self._rewind)  # the next epoch's order draws from the RNG
                if micro >= plan.batches_per_epoch:  # the epoch ran to its end
                    self.position = DataPosition(epoch + 1, 0)
                    ctx.state.epoch = float(epoch + 1)
                events.fire("on_epoch_end")
                self._log_save_evaluate()
                if ctx.control.should_training_stop:
                    return

    def _stop_for_signal(self, signum: int | None) -> None:
        self.interrupted = signum or 15
        control = self.run_ctx.control
        control.should_save = True
        control.should_training_stop = True
        logger.warning(
            "signal %s received: saving a checkpoint at step %d and stopping", signum, self.run_ctx.state.global_step
        )

    def _micro_batch(self, batch: Any, items: Any = None) -> bool:
        """Forward, backward and (on the last micro-batch of a step) the optimizer step; ``items``: the window's
        label tokens for compute_loss_func (loss_items.py). Returns whether the optimizer stepped."""
        ctx, acc = self.run_ctx, self.run_ctx.accelerator
        if self._micro_in_step == 0:
            ctx.control.new_step()
            ctx.events.fire("on_step_begin")
            ctx.meter.phases.lap("callbacks_logging")
            self.compile.step_begins()
        self._micro_in_step += 1
        if acc.precision_pending:
            ctx.meter.phases.lap("callbacks_logging")
            self._settle_precision(batch)
            ctx.meter.phases.lap("race")  # a race aside (a run's own first steps count as forward and backward)
        if self._rewind is not None:  # a race step's micro-batch: replayed once the race decides
            self._rewind.keep(batch, acc.gradient_state.end_of_dataloader, items)
        with acc.accumulate(ctx.model):
            # training_step returns the loss divided by the accumulation steps (HF's); the meter averages the
            # micro-batches' own losses. Its forward ends with a lap inside it (Trainer.training_step): an
            # override that never calls it leaves the micro-batch unsplit
            loss = self.compile.call(ctx.training_step, ctx.model, batch, *([] if items is None else [items]))
            clock = ctx.meter.phases
            clock.lap("backward" if clock.last == "forward" else UNSPLIT)
            if ctx.args.gradient_accumulation_steps > 1:
                loss = loss * ctx.args.gradient_accumulation_steps
            ctx.meter.add(loss, count_samples(batch), count_tokens(batch))
            if (mode := ctx.args.include_num_input_tokens_seen) != "no":
                ctx.state.num_input_tokens_seen += input_tokens_seen(acc, batch, mode, self._main_input)
            clock.lap("callbacks_logging")  # the meter's running loss and counts
            if not acc.sync_gradients:
                return False
            self._optimizer_step()
        self._micro_in_step = 0
        if self._undecided and acc.precision.decided:  # decided at this step (auto's race as the steps)
            self._undecided = False
            self._replay_race()
            self._precision_decided(steps_done=1)
        return True

    def _replay_race(self) -> None:
        """The in-run race decided: the run goes back to before it and takes its steps again in the chosen mode
        (race_rewind.py), outside the accumulation window that just closed; timed as the race's."""
        rewind, self._rewind = self._rewind, None
        if rewind is not None and rewind.pays(self.plan.max_steps, self.run_ctx.args.gradient_accumulation_steps):
            with self.run_ctx.meter.phases.within("race"):  # its steps lap forward, backward...: all the race's
                rewind.replay(self.run_ctx)  # the decision records its steps and seconds

    def _settle_precision(self, batch: Any) -> None:
        """A precision decided on the training step ("auto"): it decides on this first batch through the
        Trainer's own ``compute_loss`` (nothing of it reaches training), told the run's facts (the passes left,
        the formats a diagnosis saw overflow); logged once decided, now or at a later step."""
        ctx, acc = self.run_ctx, self.run_ctx.accelerator
        # the decision's budget is a share of the forward+backward passes still to run (one per micro-batch)
        passes = max(1, ctx.state.max_steps - ctx.state.global_step) * ctx.args.gradient_accumulation_steps
        acc.settle_precision(
            lambda: ctx.compute_loss(ctx.model, batch),
            batch,
            unsafe_formats=overflowed_formats(ctx.diagnosis),
            run_steps=passes,
            compile_asked=ctx.args.torch_compile,
            quiet_steps=steps_to_first_look(ctx.args, ctx.state, self.plan.steps_per_epoch),  # ends before them
        )
        self._undecided = not acc.precision.decided
        if not self._undecided:
            self._precision_decided()
        else:  # racing as the run's own steps: the state they start from, to replay them in the chosen mode
            self._rewind = RaceRewind.take(ctx)

    def _precision_decided(self, steps_done: int = 0) -> None:
        """Log auto's decision (made now, ``steps_done`` steps into this step: 1 when the race ran as the
        training steps and this step ended it) and read the chosen mode's scaler."""
        ctx, decision = self.run_ctx, self.run_ctx.accelerator.auto_decision
        if decision is not None:
            ctx.events.record("auto_precision", ctx.state.global_step + steps_done, **decision.to_dict())
            logger.info("%s", decision.explain())
        self._start_scaling()

    def _start_scaling(self) -> None:
        """Read the (decided) precision's scaler: whether it scales, and the scale to log changes from."""
        scaler = self.run_ctx.accelerator.scaler
        self._scaling = scaler.is_enabled()
        self._last_scale = scaler.get_scale() if self._scaling else None
        if self._scaling:
            self.run_ctx.events.record("loss_scale", self.run_ctx.state.global_step, scale=self._last_scale)

    def _optimizer_step(self) -> None:
        ctx = self.run_ctx
        acc, args, events = ctx.accelerator, ctx.args, ctx.events
        if args.max_grad_norm:
            self._grad_norm = acc.clip_grad_norm_(ctx.model.parameters(), args.max_grad_norm)
        ctx.meter.phases.lap("clip")
        events.fire("on_pre_optimizer_step")
        # the scale this step runs with (under auto's in-run race, its mode's): a host mirror, no sync. Not the last
        # logged one, which is None until a scaling mode is decided ("loss scale 0" on a race step, issue 34)
        scale_used = acc.scaler.get_scale()
        try:
            ctx.optimizer.step()
        except ConsecutiveSkipsError as err:
            raise self._skips_error(err) from err
        skipped = acc.optimizer_step_was_skipped
        if skipped:
            self._record_skip(scale_used)
        events.fire("on_optimizer_step", skipped=skipped)
        ctx.meter.learning_rate = float(ctx.lr_scheduler.get_last_lr()[0])  # this step's, logged (HF's)
        ctx.lr_scheduler.step()  # the prepared scheduler holds still after a skipped step
        ctx.optimizer.zero_grad()
        self.compile.step_ended(self.plan.max_steps - ctx.state.global_step - 1)
        ctx.meter.phases.lap("optimizer")
        if self._scaling:
            scale = acc.scaler.get_scale()  # a host mirror: no sync
            if scale != self._last_scale:
                self._last_scale = scale
                events.record("loss_scale", ctx.state.global_step + 1, scale=scale)

    def _record_skip(self, scale_used: float) -> None:
        """Log which parameters held non-finite gradients. One host sync, on skipped steps only, before
        zero_grad clears the evidence."""
        ctx = self.run_ctx
        names = ctx.accelerator.scaler.nonfinite_grad_names(ctx.optimizer)  # reads its param_groups only
        step = ctx.state.global_step + 1
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        race = {"race_step": True} if self._undecided else {}  # replayed in the chosen mode once the race decides
        logger.warning(
            "step %d: optimizer step skipped (loss scale %g%s): non-finite gradients in %s",
            step,
            scale_used,
            ", a step of auto's race" if race else "",
            shown or "no parameter (a gradient hook or another process?)",
        )
        ctx.events.record("skipped_step", step, loss_scale=scale_used, nonfinite_grads=names, **race)

    def _skips_error(self, err: ConsecutiveSkipsError) -> ConsecutiveSkipsError:
        ctx = self.run_ctx
        last = ckpt.latest_checkpoint(ctx.args.output_dir)
        message = (
            f"Trainer stopped at step {ctx.state.global_step + 1} (epoch {ctx.state.epoch or 0.0:.2f}, precision "
            f"{ctx.accelerator.mixed_precision}): {err} Nothing was saved from this state; the last complete "
            f"checkpoint is {last if last else 'none'}."
        )
        watch = getattr(ctx.accelerator, "watch", None)
        if watch is not None and watch.skip_counts:  # the precision watch traced earlier skips to modules
            traced = ", ".join(f"{name} ({n} skips)" for name, n in watch.skip_counts.most_common(3))
            message += f" The precision watch traced the skipped steps to: {traced}."
        ctx.events.record("stopped", ctx.state.global_step + 1, reason=message)
        ctx.events.close_progress()
        return ConsecutiveSkipsError(message)

    # -- between steps: what the callbacks' control asks for -----------------------------------------

    def _log_save_evaluate(self) -> None:
        ctx = self.run_ctx
        control, clock = ctx.control, ctx.meter.phases
        clock.lap("callbacks_logging")  # the step's end: on_step_end and its callbacks
        if control.should_log:
            control.should_log = False
            self._log_training()
            clock.lap("callbacks_logging")
        if control.should_evaluate:
            control.should_evaluate = False
            metrics = ctx.evaluate()
            clock.lap("evaluation")
            new_best = track_best(ctx.args, ctx.state, metrics)
            if ctx.args.save_strategy == "best":  # HF: save exactly when an evaluation finds a new best
                ctx.control.should_save = new_best
        control = ctx.control  # an event during the evaluation may have replaced it
        if control.should_save:
            control.should_save = False
            ctx.state.stateful_callbacks = export_callback_states(ctx.events.handler.callbacks, control)
            ckpt.save_trainer_checkpoint(ctx, self.position)
            clock.lap("save")

    def _log_training(self) -> None:
        ctx = self.run_ctx
        window = ctx.meter.take_window()  # a host sync, on logging steps only
        if window is None:
            return
        loss, filtered = window
        logs: dict[str, Any] = {"loss": loss}
        if filtered:  # logging_nan_inf_filter left these inf/NaN micro-batch losses out of the mean
            logs["nonfinite_losses"] = filtered
        if self._grad_norm is not None:
            logs["grad_norm"] = float(self._grad_norm)
        logs["learning_rate"] = ctx.meter.learning_rate
        scaler = ctx.accelerator.scaler
        if scaler.is_enabled():
            logs["loss_scale"] = scaler.get_scale()
            logs["skipped_steps"] = scaler.record.skipped_steps
        ctx.log(logs)


def track_best(args: TrainingArguments, state: TrainerState, metrics: dict[str, float]) -> bool:
    """Record a new best metric in ``state``; returns whether ``metrics`` is one."""
    ev = args.evaluation
    if not (ev.load_best_model_at_end or ev.metric_for_best_model):
        return False
    key = ev.metric_key()
    if key not in metrics:
        raise KeyError(
            f"TrainingArguments(metric_for_best_model={ev.metric_for_best_model!r}): the evaluation returned "
            f"no {key!r} (it returned {', '.join(sorted(metrics))})"
        )
    if ev.is_better(metrics[key], state.best_metric):
        state.best_metric = float(metrics[key])
        state.best_global_step = state.global_step
        return True
    return False
