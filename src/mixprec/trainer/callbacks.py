"""Callbacks with Hugging Face's contract: ``on_<event>(args, state, control, **kwargs)``.

A callback written for ``transformers.TrainerCallback`` works here unchanged: the same event names, the same
``TrainerControl`` switches, and keyword arguments ``model``, ``optimizer``, ``lr_scheduler``,
``train_dataloader``, ``eval_dataloader`` (plus ``metrics`` for on_evaluate, ``logs`` for on_log). A callback
that returns a ``TrainerControl`` replaces the one passed along, as in HF.

The default flow (when to log, evaluate and save) is itself a callback, :class:`DefaultFlowCallback`, so a user
callback can override any of its decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.state import TrainerState

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
    "on_prediction_step",
)


@dataclass
class TrainerControl:
    """Switches a callback flips to steer the loop. The step switches reset at every step, the epoch switch
    at every epoch; ``should_training_stop`` stays set."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False


class TrainerCallback:
    """Base class: every event is a no-op. Override the ones you need."""

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """At the end of ``Trainer.__init__``."""

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Before the first step (after a resume has restored the state)."""

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After the last step; ``kwargs["summary"]`` holds the end-of-run summary."""

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """At the start of an epoch."""

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """At the end of an epoch."""

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Before the first micro-batch of an optimizer step."""

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After each micro-batch that does not end an optimizer step (gradient accumulation)."""

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ):
        """After gradient clipping, before ``optimizer.step()``."""

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After ``optimizer.step()`` (``kwargs["skipped"]`` says whether the scaler skipped it), before zero_grad."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After an optimizer step; ``state.global_step`` counts it."""

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After an evaluation; ``kwargs["metrics"]`` holds its metrics."""

    def on_predict(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After ``Trainer.predict``; ``kwargs["metrics"]`` holds its metrics."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After a checkpoint is complete on disk; ``kwargs["checkpoint"]`` is its folder."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After an entry was appended to ``state.log_history``; ``kwargs["logs"]`` is the entry."""

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """After each evaluation or prediction batch."""


class CallbackHandler:
    """Calls every callback for an event, in order, passing the trainer's objects as keyword arguments."""

    def __init__(self, callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks or []:
            self.add_callback(cb)
        # Filled in by the Trainer once they exist; passed to every event.
        self.model: Any = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.train_dataloader: Any = None
        self.eval_dataloader: Any = None

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        cb = callback() if isinstance(callback, type) else callback
        missing = [e for e in ("on_step_end", "on_log") if not callable(getattr(cb, e, None))]
        if missing:
            raise TypeError(
                f"callback {type(cb).__name__} has no {', '.join(missing)}; subclass mixprec.TrainerCallback"
            )
        self.callbacks.append(cb)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        for i, cb in enumerate(self.callbacks):
            if cb is callback or (isinstance(callback, type) and type(cb) is callback):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.pop_callback(callback)

    def call_event(
        self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:  # an HF callback from an older transformers may lack a newer event
                continue
            result = method(
                args,
                state,
                control,
                model=self.model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            if result is not None:
                control = result
        return control


class DefaultFlowCallback(TrainerCallback):
    """HF's default flow: log, evaluate and save on the configured step or epoch boundaries, and at the last
    step (evaluate if that step was not an evaluation step already, save when saving by steps)."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            control.should_log = control.should_log or args.logging_strategy != "no"
            if args.eval_strategy == "steps" and step % state.eval_steps != 0:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch":
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control
