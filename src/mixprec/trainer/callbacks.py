"""Callbacks with Hugging Face's contract: ``on_<event>(args, state, control, **kwargs)``.

A callback written for ``transformers.TrainerCallback`` works here unchanged: the same event names, the same
``TrainerControl`` switches, and keyword arguments ``model``, ``optimizer``, ``lr_scheduler``,
``train_dataloader``, ``eval_dataloader`` (plus ``metrics`` for on_evaluate, ``logs`` for on_log). A callback
that returns a ``TrainerControl`` replaces the one passed along, as in HF.

The default flow (when to log, evaluate and save) is itself a callback, :class:`DefaultFlowCallback`, so a user
callback can override any of its decisions.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mixprec.trainer.hf_loggers import hf_logger

if TYPE_CHECKING:
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.state import TrainerState

logger = logging.getLogger("mixprec.trainer")


class ExportableState:
    """A callback whose state is saved in checkpoints (``trainer_state.json``, "stateful_callbacks") and, with
    ``TrainingArguments(restore_callback_states_from_checkpoint=True)``, restored on resume (HF's contract).
    ``state()`` returns ``{"args": <constructor kwargs>, "attributes": <attributes set afterwards>}``."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the callback, in the form above (a subclass defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement state() to be saved with checkpoints")

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Any:
        """The callback :meth:`state` describes: built from its ``args``, then its ``attributes`` set."""
        instance = cls(**state.get("args", {}))
        for key, value in state.get("attributes", {}).items():
            setattr(instance, key, value)
        return instance


def _is_stateful(obj: Any) -> bool:
    # HF's own ExportableState subclasses count too (a callback written for transformers, unchanged)
    return isinstance(obj, ExportableState) or (callable(getattr(obj, "state", None)) and hasattr(obj, "from_state"))


@dataclass
class TrainerControl(ExportableState):
    """Switches a callback flips to steer the loop. The step switches reset at every step, the epoch switch
    at every epoch; ``should_training_stop`` stays set."""

    should_training_stop: bool = False
    """Stop training after this step (set by EarlyStoppingCallback, a SIGTERM or a callback)."""
    should_epoch_stop: bool = False
    """End the current epoch after this step."""
    should_save: bool = False
    """Save a checkpoint after this step."""
    should_evaluate: bool = False
    """Evaluate after this step."""
    should_log: bool = False
    """Log after this step."""

    def new_training(self) -> None:
        """Called by the training loop when a run begins."""
        self.should_training_stop = False

    def new_epoch(self) -> None:
        """Called by the training loop at each epoch's start: ``should_epoch_stop`` resets."""
        self.should_epoch_stop = False

    def new_step(self) -> None:
        """Called by the training loop at each optimizer step's start: the step switches reset."""
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    # HF's names for the three resets (transformers' own tests and some callbacks call them)
    _new_training = new_training
    _new_epoch = new_epoch
    _new_step = new_step

    def state(self) -> dict[str, Any]:
        """The switches, for a checkpoint (HF's ``ExportableState``)."""
        return {"args": {f.name: getattr(self, f.name) for f in fields(self)}, "attributes": {}}


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

    def on_push_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Before a push to the Hugging Face Hub (HF's event; mixprec's Trainer never pushes, so only code that
        calls ``callback_handler.on_push_begin`` fires it)."""


EVENTS = tuple(name for name in vars(TrainerCallback) if name.startswith("on_"))
"""Every event's name, in the order TrainerCallback declares them."""


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
        """Add a callback (an instance, or a class to instantiate) to the ones the Trainer calls."""
        cb = callback() if isinstance(callback, type) else callback
        if any(type(c) is type(cb) for c in self.callbacks):  # as HF: allowed, but usually a mistake
            # Formatted here, naming the class as HF does ({type(cb)}): HF's tests read the message from a
            # patched ``transformers.trainer_callback.logger.warning``'s first argument.
            names = ", ".join(type(c).__name__ for c in self.callbacks)
            message = f"adding a second {type(cb)} to the Trainer's callbacks (it has: {names})"
            hf_logger("trainer_callback").warning(message)
        missing = [e for e in ("on_step_end", "on_log") if not callable(getattr(cb, e, None))]
        if missing:
            raise TypeError(
                f"callback {type(cb).__name__} has no {', '.join(missing)}; subclass mixprec.TrainerCallback"
            )
        self.callbacks.append(cb)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove and return ``callback``, or given a class the first callback that is an instance of it (a
        subclass's included, as HF's); None when there is none."""
        for i, cb in enumerate(self.callbacks):
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.pop_callback(callback)

    def __getattr__(self, name: str) -> Any:
        # HF's handler has a method per event: ``handler.on_log(args, state, control, logs=...)``
        if name in EVENTS:
            return functools.partial(self.call_event, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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


def steps_to_first_look(args: TrainingArguments, state: TrainerState, steps_per_epoch: int) -> int | None:
    """The optimizer steps from ``state.global_step`` to the first at which the default flow below evaluates or
    saves (by steps, or at an epoch's end); None when it does neither. auto's race as the run's steps ends
    before then, so that what is evaluated or saved is the chosen mode's run."""
    gaps = []
    for strategy, every in ((args.eval_strategy, state.eval_steps), (args.save_strategy, state.save_steps)):
        every = every if strategy == "steps" else steps_per_epoch if strategy == "epoch" else 0
        if every:
            gaps.append(every - state.global_step % every)
    return min(gaps, default=None)


class DefaultFlowCallback(TrainerCallback):
    """HF's default flow: log, evaluate and save on the configured step or epoch boundaries, and at the last
    step (evaluate if that step was not an evaluation step already, save when saving by steps)."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and step % state.eval_steps == 0 and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            if args.eval_strategy == "steps" and step % state.eval_steps != 0 and args.eval_delay <= step:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= (state.epoch or 0.0):
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stop training when ``metric_for_best_model`` has not improved for ``early_stopping_patience``
    evaluations in a row (HF's semantics: an improvement must beat the best so far by more than
    ``early_stopping_threshold``; the best is the Trainer's ``state.best_metric``, updated after this check).

    Needs an evaluation strategy and a metric; with ``load_best_model_at_end=True`` (which fills the metric
    in as "loss") the best model is restored when it stops.
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0) -> None:
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0
        """Evaluations in a row that did not improve on the best metric."""

    def check_metric_value(self, args: Any, state: Any, control: TrainerControl, metric_value: float) -> None:
        """Count an evaluation that does not beat the best metric by ``early_stopping_threshold`` (HF's)."""
        best = state.best_metric
        if best is None:
            self.early_stopping_patience_counter = 0
            return
        better = metric_value > best if args.greater_is_better else metric_value < best
        if better and abs(metric_value - best) > self.early_stopping_threshold:
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> None:
        if args.metric_for_best_model is None:
            raise ValueError(
                "EarlyStoppingCallback needs TrainingArguments(metric_for_best_model=...) (or "
                "load_best_model_at_end=True, which sets it to 'loss')"
            )
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs TrainingArguments(eval_strategy='steps' or 'epoch')")
        if not args.load_best_model_at_end:
            logger.warning(
                "EarlyStoppingCallback without load_best_model_at_end=True: the best model will not be "
                "loaded when training stops"
            )

    def on_evaluate(self, args: Any, state: Any, control: TrainerControl, metrics: Any = None, **kwargs: Any):
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        value = (metrics or {}).get(key)
        if value is None:
            logger.warning("EarlyStoppingCallback: the evaluation returned no %r; early stopping is off", key)
            return None
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True
        return None

    def state(self) -> dict[str, Any]:
        """HF's ExportableState form: the arguments and the counter."""
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }


def export_callback_states(callbacks: list[Any], control: TrainerControl) -> dict[str, Any]:
    """HF's ``stateful_callbacks``: class name -> ``state()`` (a list of them for several of one class)."""
    states: dict[str, Any] = {}
    for cb in [*callbacks, control]:
        if not _is_stateful(cb):
            continue
        name, value = type(cb).__name__, cb.state()
        if name in states:
            states[name] = (states[name] if isinstance(states[name], list) else [states[name]]) + [value]
        else:
            states[name] = value
    return states


def restore_callback_states(
    handler: CallbackHandler, control: TrainerControl, stored: dict[str, Any]
) -> TrainerControl:
    """Rebuild each stateful callback (and the control) from a checkpoint's ``stateful_callbacks``, matched by
    class name and, for several of one class, by order (HF's rule); returns the control to use."""
    for name, data in (stored or {}).items():
        states = data if isinstance(data, list) else [data]
        if name == type(control).__name__:
            control = type(control).from_state(states[0])
            continue
        matching = [cb for cb in handler.callbacks if type(cb).__name__ == name and _is_stateful(cb)]
        if not matching:
            message = f"checkpoint holds the state of callback {name}, which this Trainer does not have"
            hf_logger("trainer").warning(message)  # formatted: HF's test reads the patched warning's argument
        for cb, state in zip(matching, states):
            handler.callbacks[handler.callbacks.index(cb)] = type(cb).from_state(state)
    return control
