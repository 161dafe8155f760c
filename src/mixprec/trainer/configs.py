"""The grouped views of TrainingArguments, derived from its flat fields, and the checks each group makes.

Every field is declared once, with its docstring, on :class:`~mixprec.trainer.args.TrainingArguments`. A view
here only names which of those fields it groups (``FIELDS``), copies their values when it is built
(``args.precision_config``, ``args.optimization``, ``args.schedule``, ``args.evaluation``, ``args.checkpointing``,
``args.logging``: built on each access, so an edit after construction is seen and validated) and checks them in
``__post_init__``. Views are frozen: code the Trainer hands one to cannot change the run's arguments. Messages
name the ``TrainingArguments`` field and the fix, since that is what the user wrote.
"""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError
from typing import Any, ClassVar

from mixprec.trainer.optimizers import OPTIMIZER_NAMES, SCHEDULER_NAMES, parse_optim_args

STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = (*STRATEGIES, "best")
REPORTERS = ("tensorboard", "mlflow", "wandb")  # JSONL is always written; these are the extras
DISTRIBUTED = (None, "ddp", "fsdp")


def fail(name: str, value: Any, rule: str) -> None:
    raise ValueError(f"TrainingArguments({name}={value!r}): {rule}")


def check_positive_int(name: str, value: Any, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        fail(name, value, f"must be an integer >= {low}")


def check_steps(name: str, value: Any) -> None:
    """An interval in optimizer steps: an integer >= 1, or a float in (0, 1) read as a ratio of the run."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        fail(name, value, "must be an integer >= 1, or a float in (0, 1) for a ratio of the total steps")
    if value >= 1 and value != int(value):
        fail(name, value, "must be an integer when >= 1 (a float below 1 is a ratio of the total steps)")


def resolve_steps(value: float, max_steps: int) -> int:
    """Steps for an interval given as an integer or as a ratio (< 1) of ``max_steps`` (rounded up, >= 1)."""
    if value < 1:
        return max(1, math.ceil(value * max_steps))
    return int(value)


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        fail(name, value, f"choose one of: {', '.join(map(repr, choices))}")


# -- the grouped views --------------------------------------------------------------------------------


class ArgsView:
    """A frozen copy of the ``FIELDS`` of a TrainingArguments (or of any object holding them)."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, args: Any) -> None:
        for name in self.FIELDS:
            object.__setattr__(self, name, getattr(args, name))
        self.__post_init__()

    def __post_init__(self) -> None:
        """Check the group's fields; each failure names the TrainingArguments field."""

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not among FIELDS
        raise AttributeError(f"{type(self).__name__} has no field {name!r}; it groups {', '.join(self.FIELDS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}: set it on the TrainingArguments")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]  # a list-valued field would make hashing fail anyway

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.FIELDS)})"


class PrecisionConfig(ArgsView):
    """Which precision, and how the fp16 loss scaler behaves."""

    FIELDS = (
        "precision",
        "init_loss_scale",
        "loss_scale_growth_interval",
        "loss_scale_hysteresis",
        "min_loss_scale",
        "max_consecutive_skips",
        "diagnose_at_start",
    )

    def __post_init__(self) -> None:
        if not self.init_loss_scale > 0:
            fail("init_loss_scale", self.init_loss_scale, "must be > 0 (for example 2**16)")
        if not self.min_loss_scale > 0:
            fail("min_loss_scale", self.min_loss_scale, "must be > 0")
        if self.init_loss_scale < self.min_loss_scale:
            fail("init_loss_scale", self.init_loss_scale, f"must be >= min_loss_scale={self.min_loss_scale}")
        check_positive_int("loss_scale_growth_interval", self.loss_scale_growth_interval)
        check_positive_int("loss_scale_hysteresis", self.loss_scale_hysteresis)
        if self.max_consecutive_skips is not None:
            check_positive_int("max_consecutive_skips", self.max_consecutive_skips)

    def scaler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~mixprec.scaling.scaler.GradScaler` (via the Accelerator)."""
        return {
            "init_scale": float(self.init_loss_scale),
            "growth_interval": self.loss_scale_growth_interval,
            "hysteresis": self.loss_scale_hysteresis,
            "min_scale": float(self.min_loss_scale),
            "max_consecutive_skips": self.max_consecutive_skips,
        }


class OptimConfig(ArgsView):
    """The optimizer built when ``Trainer(optimizers=(None, ...))``, and what happens to each step."""

    FIELDS = (
        "optim",
        "optim_args",
        "learning_rate",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "gradient_accumulation_steps",
    )

    def __post_init__(self) -> None:
        check_choice("optim", self.optim, OPTIMIZER_NAMES)
        parse_optim_args(self.optim, self.optim_args)
        if not self.learning_rate >= 0:
            fail("learning_rate", self.learning_rate, "must be >= 0")
        if not self.weight_decay >= 0:
            fail("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(name, getattr(self, name), "must be in [0, 1)")
        if not self.adam_epsilon > 0:
            fail("adam_epsilon", self.adam_epsilon, "must be > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            fail("max_grad_norm", self.max_grad_norm, "must be >= 0 (0 or None turns clipping off)")
        check_positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)


class ScheduleConfig(ArgsView):
    """How long to train and how the learning rate moves."""

    FIELDS = ("num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_steps", "warmup_ratio")

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int):
            fail("max_steps", self.max_steps, "must be an integer (-1 to train for num_train_epochs)")
        if self.max_steps == 0 or self.max_steps < -1:
            fail("max_steps", self.max_steps, "must be > 0, or -1 to train for num_train_epochs")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            fail("num_train_epochs", self.num_train_epochs, "must be > 0 (or set max_steps > 0)")
        check_choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_NAMES)
        ws = self.warmup_steps
        if isinstance(ws, bool) or not isinstance(ws, (int, float)) or ws < 0 or (ws >= 1 and ws != int(ws)):
            fail("warmup_steps", ws, "must be an integer >= 0, or a float in (0, 1) for a ratio of the total steps")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            fail("warmup_ratio", self.warmup_ratio, "must be in [0, 1]")
        if self.warmup_steps > 0 and self.warmup_ratio > 0:
            fail("warmup_ratio", self.warmup_ratio, f"set warmup_steps={self.warmup_steps} or warmup_ratio, not both")

    def num_warmup_steps(self, total_steps: int) -> int:
        """Warmup in optimizer steps: warmup_steps if set, else ceil(warmup_ratio * total) as HF does."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:  # HF 5: a float below 1 is a ratio, as warmup_ratio
            return math.ceil(self.warmup_steps * total_steps)
        return math.ceil(self.warmup_ratio * total_steps)


class EvalConfig(ArgsView):
    """When to evaluate, and which metric decides the best checkpoint."""

    FIELDS = (
        "eval_strategy",
        "eval_steps",
        "per_device_eval_batch_size",
        "load_best_model_at_end",
        "metric_for_best_model",
        "greater_is_better",
        "prediction_loss_only",
    )

    def __post_init__(self) -> None:
        check_choice("eval_strategy", self.eval_strategy, STRATEGIES)
        check_steps("eval_steps", self.eval_steps)
        check_positive_int("per_device_eval_batch_size", self.per_device_eval_batch_size)

    def metric_key(self) -> str:
        """The log key of the best-model metric ("eval_loss" by default)."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    def is_better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        greater = self.greater_is_better
        if greater is None:  # HF's rule: losses are minimised, every other metric maximised
            greater = self.metric_key() != "eval_loss"
        return value > best if greater else value < best


class CheckpointConfig(ArgsView):
    """When to write checkpoint-N folders and how many to keep."""

    FIELDS = ("save_strategy", "save_steps", "save_total_limit")

    def __post_init__(self) -> None:
        check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        check_steps("save_steps", self.save_steps)
        if self.save_total_limit is not None:
            check_positive_int("save_total_limit", self.save_total_limit)


class LoggingConfig(ArgsView):
    """What is logged, how often, and where (metrics.jsonl always; TensorBoard when asked)."""

    FIELDS = (
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "report_to",
        "logging_dir",
        "disable_tqdm",
        "save_plots",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "report_to", tuple(self.report_to))  # frozen: a tuple, not the args' list
        check_choice("logging_strategy", self.logging_strategy, STRATEGIES)
        check_steps("logging_steps", self.logging_steps)
        for name in self.report_to:
            if name not in REPORTERS:
                fail(
                    "report_to",
                    name,
                    f"mixprec reports to: {', '.join(REPORTERS)}, 'all' or 'none' (metrics.jsonl is always written)",
                )


def accelerator_kwargs(args: Any) -> dict[str, Any]:
    """The Trainer's :class:`~mixprec.accelerator.accelerator.Accelerator` arguments, derived from the flat
    fields as the views are (the scaler's from :class:`PrecisionConfig`)."""
    return {
        "mixed_precision": args.precision_strategy if args.precision_strategy is not None else args.precision,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "distributed": args.distributed,
        "fsdp_state_dict_type": args.fsdp_state_dict_type,
        "cpu": args.use_cpu,
        "scaler_kwargs": PrecisionConfig(args).scaler_kwargs(),
        "ddp_kwargs": args.ddp_kwargs() or None,
        "watch": args.precision_watch,
        "timeout": args.ddp_timeout,
        "comm_dtype": args.comm_dtype,
        "step_in_backward": args.step_in_backward,
        "dataloader_config": args.dataloader_configuration(),
        "scheduler_counts_optimizer_steps": True,  # the Trainer sizes its schedule in optimizer steps
    }
