"""TrainingArguments: Hugging Face's names and defaults on the surface, small validated configs underneath.

A script moves over from ``transformers`` by changing its import: the fields that overlap with HF's
``TrainingArguments`` keep HF's names and defaults (3 epochs, batch 8, lr 5e-5, linear schedule, Adam betas
(0.9, 0.999), eps 1e-8, logging and saving every 500 steps, seed 42). ``evaluation_strategy``, which HF
Transformers 5 rejects with a TypeError, is accepted as an alias of ``eval_strategy``.

The flat dataclass is what users write; the Trainer reads the grouped views (``args.precision_config``,
``args.optimization``, ``args.schedule``, ``args.evaluation``, ``args.checkpointing``, ``args.logging``),
each a frozen dataclass that validates its own fields in ``__post_init__``. They are built on access, so a
script that edits ``args.num_train_epochs = 5`` after construction is still validated and still seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from mixprec.precision.registry import canonical_name

STRATEGIES = ("no", "steps", "epoch")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
REPORTERS = ("tensorboard",)  # JSONL is always written; these are the extras
DISTRIBUTED = (None, "ddp", "fsdp")


def _fail(name: str, value: Any, rule: str) -> None:
    raise ValueError(f"TrainingArguments({name}={value!r}): {rule}")


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(name, value, f"must be an integer >= {low}")


def _choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"choose one of: {', '.join(map(repr, choices))}")


# -- the grouped configs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionConfig:
    """Which precision, and how the fp16 loss scaler behaves."""

    precision: str
    """Canonical precision name: "fp32", "fp16", "bf16" or "auto" (resolved by the Accelerator)."""
    init_loss_scale: float
    """Loss scale of the first step (fp16 only)."""
    loss_scale_growth_interval: int
    """Clean steps before the scale doubles."""
    loss_scale_hysteresis: int
    """Overflowing steps tolerated before the scale halves."""
    min_loss_scale: float
    """Floor the scale never falls below."""
    max_consecutive_skips: int | None
    """Skipped steps in a row that stop training with ConsecutiveSkipsError (None: never)."""
    diagnose_at_start: bool
    """Run mixprec.diagnostics.diagnose first and start the scaler at its recommended scale."""

    def __post_init__(self) -> None:
        if not self.init_loss_scale > 0:
            _fail("init_loss_scale", self.init_loss_scale, "must be > 0 (for example 2**16)")
        if not self.min_loss_scale > 0:
            _fail("min_loss_scale", self.min_loss_scale, "must be > 0")
        if self.init_loss_scale < self.min_loss_scale:
            _fail("init_loss_scale", self.init_loss_scale, f"must be >= min_loss_scale={self.min_loss_scale}")
        _positive_int("loss_scale_growth_interval", self.loss_scale_growth_interval)
        _positive_int("loss_scale_hysteresis", self.loss_scale_hysteresis)
        if self.max_consecutive_skips is not None:
            _positive_int("max_consecutive_skips", self.max_consecutive_skips)

    def scaler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~mixprec.scaling.scaler.GradScaler` (via the Accelerator)."""
        return {
            "init_scale": float(self.init_loss_scale),
            "growth_interval": self.loss_scale_growth_interval,
            "hysteresis": self.loss_scale_hysteresis,
            "min_scale": float(self.min_loss_scale),
            "max_consecutive_skips": self.max_consecutive_skips,
        }


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer built when ``Trainer(optimizers=(None, ...))``, and what happens to each step."""

    optim: str
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float | None
    gradient_accumulation_steps: int

    def __post_init__(self) -> None:
        _choice("optim", self.optim, OPTIMIZERS)
        if not self.learning_rate >= 0:
            _fail("learning_rate", self.learning_rate, "must be >= 0")
        if not self.weight_decay >= 0:
            _fail("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(name, getattr(self, name), "must be in [0, 1)")
        if not self.adam_epsilon > 0:
            _fail("adam_epsilon", self.adam_epsilon, "must be > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            _fail("max_grad_norm", self.max_grad_norm, "must be >= 0 (0 or None turns clipping off)")
        _positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)


@dataclass(frozen=True)
class ScheduleConfig:
    """How long to train and how the learning rate moves."""

    num_train_epochs: float
    max_steps: int
    """Optimizer steps to run; overrides num_train_epochs when > 0 (-1: use num_train_epochs)."""
    lr_scheduler_type: str
    warmup_steps: int
    warmup_ratio: float

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int):
            _fail("max_steps", self.max_steps, "must be an integer (-1 to train for num_train_epochs)")
        if self.max_steps == 0 or self.max_steps < -1:
            _fail("max_steps", self.max_steps, "must be > 0, or -1 to train for num_train_epochs")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            _fail("num_train_epochs", self.num_train_epochs, "must be > 0 (or set max_steps > 0)")
        _choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        _positive_int("warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.warmup_ratio <= 1.0:
            _fail("warmup_ratio", self.warmup_ratio, "must be in [0, 1]")
        if self.warmup_steps > 0 and self.warmup_ratio > 0:
            _fail("warmup_ratio", self.warmup_ratio, f"set warmup_steps={self.warmup_steps} or warmup_ratio, not both")

    def num_warmup_steps(self, total_steps: int) -> int:
        """Warmup in optimizer steps: warmup_steps if set, else ceil(warmup_ratio * total) as HF does."""
        if self.warmup_steps > 0:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * total_steps)


@dataclass(frozen=True)
class EvalConfig:
    """When to evaluate, and which metric decides the best checkpoint."""

    eval_strategy: str
    eval_steps: int
    per_device_eval_batch_size: int
    load_best_model_at_end: bool
    metric_for_best_model: str | None
    greater_is_better: bool | None
    prediction_loss_only: bool

    def __post_init__(self) -> None:
        _choice("eval_strategy", self.eval_strategy, STRATEGIES)
        _positive_int("eval_steps", self.eval_steps)
        _positive_int("per_device_eval_batch_size", self.per_device_eval_batch_size)

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


@dataclass(frozen=True)
class CheckpointConfig:
    """When to write checkpoint-N folders and how many to keep."""

    save_strategy: str
    save_steps: int
    save_total_limit: int | None

    def __post_init__(self) -> None:
        _choice("save_strategy", self.save_strategy, STRATEGIES)
        _positive_int("save_steps", self.save_steps)
        if self.save_total_limit is not None:
            _positive_int("save_total_limit", self.save_total_limit)


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged, how often, and where (metrics.jsonl always; TensorBoard when asked)."""

    logging_strategy: str
    logging_steps: int
    logging_first_step: bool
    report_to: tuple[str, ...]
    logging_dir: str
    disable_tqdm: bool
    save_plots: bool

    def __post_init__(self) -> None:
        _choice("logging_strategy", self.logging_strategy, STRATEGIES)
        _positive_int("logging_steps", self.logging_steps)
        for name in self.report_to:
            if name not in REPORTERS:
                _fail(
                    "report_to",
                    name,
                    f"mixprec reports to: {', '.join(REPORTERS)}, 'all' or 'none' (metrics.jsonl is always written)",
                )


# -- the public, flat, HF-compatible dataclass ---------------------------------------------------------


@dataclass
class TrainingArguments:
    """Everything a :class:`~mixprec.trainer.trainer.Trainer` run needs. Field names and defaults follow
    Hugging Face's ``TrainingArguments`` where they overlap; the loss-scaler fields are mixprec's own."""

    output_dir: str = "trainer_output"
    """Where checkpoints, metrics.jsonl, plots and the final model go."""

    # -- precision ------------------------------------------------------------------------------------
    precision: str | None = None
    """"no"/"fp32", "fp16", "bf16" or "auto". fp16=True and bf16=True are sugar for it; default fp32."""
    fp16: bool = False
    """Train with fp16 autocast and loss scaling (really fp16, on CPU too)."""
    bf16: bool = False
    """Train with bf16 autocast."""
    init_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    loss_scale_hysteresis: int = 1
    min_loss_scale: float = 1.0
    max_consecutive_skips: int | None = 100
    diagnose_at_start: bool = False
    """Diagnose gradient ranges first (mixprec.diagnostics) and start the loss scale where it recommends."""

    # -- optimisation ---------------------------------------------------------------------------------
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    optim: str = "adamw_torch"
    """"adamw_torch", "adamw_torch_fused" or "sgd" (HF 5 defaults to the fused AdamW; the results match)."""
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    """Decoupled weight decay on weights with >= 2 dimensions (biases and norm gains are never decayed)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (measured on unscaled gradients); 0 or None turns clipping off."""

    # -- schedule -------------------------------------------------------------------------------------
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0

    # -- evaluation -----------------------------------------------------------------------------------
    eval_strategy: str = "no"
    evaluation_strategy: str | None = None
    """Deprecated alias of eval_strategy, accepted so older scripts (and the seed's snippet) run unchanged."""
    eval_steps: int | None = None
    """Optimizer steps between evaluations when eval_strategy="steps" (default: logging_steps)."""
    per_device_eval_batch_size: int = 8
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    prediction_loss_only: bool = False

    # -- checkpointing --------------------------------------------------------------------------------
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None

    # -- logging --------------------------------------------------------------------------------------
    logging_strategy: str = "steps"
    logging_steps: int = 500
    logging_first_step: bool = False
    logging_dir: str | None = None
    """TensorBoard event folder (default: <output_dir>/runs)."""
    report_to: str | list[str] | None = "none"
    """"tensorboard", "all" (every installed reporter) or "none"; metrics.jsonl is written regardless."""
    disable_tqdm: bool = False
    save_plots: bool = True
    """Write loss_curves.png and loss_scale.png into output_dir at the end of training."""
    run_name: str | None = None

    # -- data and runtime -----------------------------------------------------------------------------
    seed: int = 42
    data_seed: int | None = None
    """Seed of the data order (default: seed)."""
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    remove_unused_columns: bool = True
    """Drop batch keys the model's forward does not accept (e.g. a dataset's "text" column)."""
    label_names: list[str] | None = None
    """Batch keys holding labels (default: "labels"); they become EvalPrediction.label_ids."""
    torch_compile: bool = False
    use_cpu: bool = False
    """Train on the CPU even when a GPU is present."""
    distributed: str | None = None
    """None (DDP under torchrun, else one process), "ddp" or "fsdp"."""

    def __post_init__(self) -> None:
        self._merge_eval_alias()
        self._resolve_precision()
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps  # HF's default
        if self.max_grad_norm == 0:
            self.max_grad_norm = None
        self.report_to = list(self._normalise_report_to(self.report_to))
        if self.logging_dir is None:
            self.logging_dir = f"{self.output_dir.rstrip('/')}/runs"
        if self.data_seed is None:
            self.data_seed = self.seed
        _positive_int("per_device_train_batch_size", self.per_device_train_batch_size)
        _positive_int("dataloader_num_workers", self.dataloader_num_workers, allow_zero=True)
        _choice("distributed", self.distributed, DISTRIBUTED)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            _fail("seed", self.seed, "must be an integer")
        self.validate()

    # -- normalisation --------------------------------------------------------------------------------

    def _merge_eval_alias(self) -> None:
        alias = self.evaluation_strategy
        if alias is None:
            return
        if self.eval_strategy != "no" and self.eval_strategy != alias:
            _fail(
                "evaluation_strategy",
                alias,
                f"conflicts with eval_strategy={self.eval_strategy!r}; they are the same setting, set only "
                "eval_strategy",
            )
        self.eval_strategy = alias
        self.evaluation_strategy = None  # one source of truth from here on

    def _resolve_precision(self) -> None:
        if self.fp16 and self.bf16:
            _fail("bf16", self.bf16, "fp16=True and bf16=True were both set; choose one (or set precision=...)")
        flag = "fp16" if self.fp16 else "bf16" if self.bf16 else None
        if self.precision is None:
            self.precision = flag or "fp32"
        try:
            name = canonical_name(self.precision)  # the one place precision names are parsed
        except (TypeError, ValueError) as err:
            raise ValueError(f"TrainingArguments(precision={self.precision!r}): {err}") from None
        if flag is not None and name != flag:
            _fail("precision", self.precision, f"conflicts with {flag}=True; set one of them")
        self.precision = name
        # Keep the HF flags truthful, so code that reads args.fp16 sees what will run.
        self.fp16 = name == "fp16"
        self.bf16 = name == "bf16"

    @staticmethod
    def _normalise_report_to(value: str | list[str] | None) -> tuple[str, ...]:
        names = [value] if isinstance(value, str) else list(value or [])
        if "none" in names:
            if len(names) > 1:
                _fail("report_to", value, "'none' cannot be combined with other reporters")
            return ()
        if "all" in names:
            import importlib.util

            return tuple(n for n in REPORTERS if importlib.util.find_spec(n) is not None)
        return tuple(names)

    # -- grouped views --------------------------------------------------------------------------------

    def _group(self, cls: type) -> Any:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @property
    def precision_config(self) -> PrecisionConfig:
        return self._group(PrecisionConfig)

    @property
    def optimization(self) -> OptimConfig:
        return self._group(OptimConfig)

    @property
    def schedule(self) -> ScheduleConfig:
        return self._group(ScheduleConfig)

    @property
    def evaluation(self) -> EvalConfig:
        return self._group(EvalConfig)

    @property
    def checkpointing(self) -> CheckpointConfig:
        return self._group(CheckpointConfig)

    @property
    def logging(self) -> LoggingConfig:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(LoggingConfig)}
        values["report_to"] = tuple(self.report_to)
        return LoggingConfig(**values)

    def validate(self) -> None:
        """Validate every group and the rules that span groups. Called at construction and by the Trainer."""
        _ = (self.precision_config, self.optimization, self.schedule, self.logging)  # each validates itself
        ev = self.evaluation
        ck = self.checkpointing
        if ev.load_best_model_at_end:
            if ev.eval_strategy == "no":
                _fail("load_best_model_at_end", True, "needs eval_strategy='steps' or 'epoch' to know the best")
            if ck.save_strategy != ev.eval_strategy:
                _fail(
                    "save_strategy",
                    ck.save_strategy,
                    f"must equal eval_strategy={ev.eval_strategy!r} when load_best_model_at_end=True, so every "
                    "evaluated model has a checkpoint to return to",
                )
            if ev.eval_strategy == "steps" and ck.save_steps % ev.eval_steps != 0:
                _fail(
                    "save_steps",
                    ck.save_steps,
                    f"must be a multiple of eval_steps={ev.eval_steps} when load_best_model_at_end=True",
                )
        if self.metric_for_best_model is not None and ev.eval_strategy == "no":
            _fail("metric_for_best_model", self.metric_for_best_model, "needs eval_strategy='steps' or 'epoch'")

    # -- serialisation --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainingArguments:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"TrainingArguments has no field(s) {', '.join(unknown)}")
        return cls(**values)
