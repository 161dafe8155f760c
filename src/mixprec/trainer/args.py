"""TrainingArguments: Hugging Face's names and defaults, each field declared once; grouped views derived.

A script moves over from ``transformers`` by changing its import: the fields that overlap with HF's
``TrainingArguments`` keep HF's names and defaults (3 epochs, batch 8, lr 5e-5, linear schedule, Adam betas (0.9,
0.999), eps 1e-8, logging and saving every 500 steps, seed 42). ``evaluation_strategy``, which HF Transformers 5 rejects
with a TypeError, is accepted as an alias of ``eval_strategy``.

Every other field of HF's ``TrainingArguments`` is accepted too (:mod:`mixprec.trainer.hf_fields`: implemented,
ignored where harmless, or refused by name). HF's properties (``train_batch_size``, ``device``, ``world_size``, ...)
are :class:`~mixprec.trainer.process_helpers.ProcessHelpers`' and what HF's fields mean is
:class:`~mixprec.trainer.hf_field_rules.HFFieldRules`': parts the class body delegates each name to.

The Trainer reads grouped views of the fields (``args.optimization``, ``args.schedule``...;
:mod:`mixprec.trainer.configs`), built on access, so an edit after construction is still validated and seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.accelerator.delegation import delegate
from mixprec.accelerator.step_in_backward import REFUSALS
from mixprec.precision.base import Precision
from mixprec.strategies.comm import make_comm
from mixprec.trainer import precision_fields
from mixprec.trainer.configs import (
    DISTRIBUTED,
    REPORTERS,
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    PrecisionConfig,
    ScheduleConfig,
    check_choice,
    check_positive_int,
    fail,
)
from mixprec.trainer.hf_field_rules import HFFieldRules
from mixprec.trainer.hf_fields import HFCompatFields
from mixprec.trainer.process_helpers import ProcessHelpers
from mixprec.watch.settings import WatchConfig

# -- the public, flat, HF-compatible dataclass ---------------------------------------------------------


@dataclass
class TrainingArguments(HFCompatFields):
    """Everything a :class:`~mixprec.trainer.trainer.Trainer` run needs. Field names and defaults follow
    Hugging Face's ``TrainingArguments`` where they overlap; the loss-scaler fields are mixprec's own; HF's
    other fields come (keyword-only) from :class:`~mixprec.trainer.hf_fields.HFCompatFields`."""

    output_dir: str = "trainer_output"
    """Where checkpoints, metrics.jsonl, plots and the final model go."""

    # -- precision ------------------------------------------------------------------------------------
    precision: str | None = None
    """A name the precision registry validates ("fp32", "fp16", "bf16", "bf16-pure", "auto", a policy, an alias):
    a plain str for HfArgumentParser, JSON and YAML. A strategy (``make_precision("bf16")``) leaves its name
    here, itself in :attr:`precision_strategy`. fp16=True and bf16=True are sugar for it; default fp32."""
    fp16: bool = False
    """Train with fp16 autocast and loss scaling (really fp16, on CPU too)."""
    bf16: bool = False
    """Train with bf16 autocast."""
    fp32_ops: list[str] | str | None = None
    """Op kinds kept in fp32 under bf16/fp16 (linear, attention, norm, softmax, embedding, activation), e.g.
    ["attention"]: ``precision`` becomes the policy "bf16:fp32_ops=attention" (mixprec.precision.op_policy)."""
    init_loss_scale: float = 2.0**16
    """Loss scale of the first step (fp16 only)."""
    loss_scale_growth_interval: int = 2000
    """Clean steps before the scale doubles."""
    loss_scale_hysteresis: int = 1
    """Overflowing steps tolerated before the scale halves."""
    min_loss_scale: float = 1.0
    """Floor the scale never falls below."""
    max_consecutive_skips: int | None = 100
    """Skipped steps in a row that stop training with ConsecutiveSkipsError (None: never)."""
    diagnose_at_start: bool = False
    """Diagnose gradient ranges first (mixprec.diagnostics) and start the loss scale where it recommends."""

    # -- optimisation ---------------------------------------------------------------------------------
    per_device_train_batch_size: int = 8
    """Training batch per process (and per GPU)."""
    gradient_accumulation_steps: int = 1
    """Batches whose gradients are summed into one optimizer step."""
    optim: str = "adamw_torch"
    """"adamw_torch", "adamw_torch_fused", "adamw_torch_8bit", "adamw_torch_4bit" (torchao: mixprec[lean]),
    "adamw_anyprecision" or "sgd", as in HF (HF 5 defaults to the fused AdamW; the results match)."""
    optim_args: str | None = None
    """Options for ``optim`` in HF's "key=value,key=value" form, e.g.
    "momentum_dtype=bfloat16,variance_dtype=bfloat16" for adamw_anyprecision (see mixprec.trainer.optimizers)."""
    learning_rate: float = 5e-5
    """Peak learning rate (after warmup, before the schedule's decay)."""
    weight_decay: float = 0.0
    """Decoupled weight decay on weights with >= 2 dimensions (biases and norm gains are never decayed)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_epsilon: float = 1e-8
    """AdamW's denominator epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (measured on unscaled gradients); 0 or None turns clipping off."""
    step_in_backward: bool = False
    """mixprec's own: update each parameter during backward and free its gradient at once, so no step holds
    the model's gradients (mixprec.accelerator.step_in_backward). Needs max_grad_norm=0 and
    gradient_accumulation_steps=1; not with fp16 or several processes."""

    # -- schedule -------------------------------------------------------------------------------------
    num_train_epochs: float = 3.0
    """Passes over the training set (a fraction stops mid-epoch); ignored when max_steps > 0."""
    max_steps: int = -1
    """Optimizer steps to run; overrides num_train_epochs when > 0 (-1: use num_train_epochs)."""
    lr_scheduler_type: str = "linear"
    """"linear", "cosine", "constant" or "constant_with_warmup" (after warmup); or "nanogpt_cosine", nanoGPT's
    schedule: "cosine" whose warm-up starts at lr / (warmup + 1) instead of 0."""
    warmup_steps: float = 0
    """Warmup in optimizer steps; a float below 1 is a ratio of the total steps (HF 5)."""
    warmup_ratio: float = 0.0
    """Warmup as a ratio of the total steps (rounded up), when warmup_steps is 0."""

    # -- evaluation -----------------------------------------------------------------------------------
    eval_strategy: str = "no"
    """"no", "steps" (every eval_steps) or "epoch"."""
    evaluation_strategy: str | None = None
    """Deprecated alias of eval_strategy, accepted so older scripts (and the seed's snippet) run unchanged."""
    eval_steps: float | None = None
    """Optimizer steps between evaluations when eval_strategy="steps" (default: logging_steps); a float
    below 1 is a ratio of the run's total steps, as in HF."""
    per_device_eval_batch_size: int = 8
    """Evaluation batch per process."""
    load_best_model_at_end: bool = False
    """Load the checkpoint with the best metric_for_best_model when training ends."""
    metric_for_best_model: str | None = None
    """The metric that picks the best checkpoint ("loss" or a compute_metrics key; the ``eval_`` prefix is optional)."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better (default: False for a loss, else True)."""
    prediction_loss_only: bool = False
    """evaluate()/predict() return only the loss, not predictions and labels."""

    # -- checkpointing --------------------------------------------------------------------------------
    save_strategy: str = "steps"
    """"no", "steps", "epoch", or "best" (save whenever an evaluation finds a new best metric)."""
    save_steps: float = 500
    """Optimizer steps between checkpoints when save_strategy="steps"; a float below 1 is a ratio of the run."""
    save_total_limit: int | None = None
    """Checkpoint folders kept (the oldest pruned first, the best one never); None keeps them all."""
    async_save: bool = False
    """Write checkpoints on a background thread while training goes on (HF has no such field): a save stalls
    the step only for a walk of the state; its host copy overlaps the next forward and backward
    (Accelerator.save_state(async_save=True)). ``on_save`` then
    fires before the folder is complete, and save_total_limit may be exceeded by one while a save is written."""

    # -- logging --------------------------------------------------------------------------------------
    logging_strategy: str = "steps"
    """"no", "steps" (every logging_steps) or "epoch"."""
    logging_steps: float = 500
    """Optimizer steps between training logs; a float below 1 is a ratio of the run's total steps."""
    logging_first_step: bool = False
    """Also log after the first optimizer step."""
    logging_dir: str | None = None
    """TensorBoard event folder (default: <output_dir>/runs)."""
    report_to: None | str | list[str] = "none"
    """"tensorboard", "all" (every installed reporter) or "none"; metrics.jsonl is written regardless."""
    disable_tqdm: bool = False
    """No progress bar (the printed log lines remain)."""
    save_plots: bool = True
    """Write loss_curves.png and loss_scale.png into output_dir at the end of training."""
    run_name: str | None = None
    """Name of the run in MLflow and Weights & Biases (report_to); None lets the tracker choose."""

    # -- data and runtime -----------------------------------------------------------------------------
    seed: int = 42
    """Seed of the initial weights (model_init), dropout and every other random draw of the run."""
    data_seed: int | None = None
    """Seed of the data order (None: ``seed``; read when ``train()`` starts, as in HF, so a later edit counts)."""
    dataloader_num_workers: int = 0
    """Worker processes that load batches (0: the training process loads them itself, as in torch)."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete training batch of each epoch."""
    remove_unused_columns: bool = True
    """Drop batch keys the model's forward does not accept (e.g. a dataset's "text" column)."""
    label_names: list[str] | None = None
    """Batch keys holding labels (default: "labels"); they become EvalPrediction.label_ids."""
    torch_compile: bool = False
    """torch.compile the model (backend torch_compile_backend, default "inductor") once its eager step is timed;
    under precision "auto" kept only where it wins its compile time back (mixprec.trainer.compile_gate)."""
    use_cpu: bool = False
    """Train on the CPU even when a GPU is present."""
    distributed: str | None = None
    """None (DDP under torchrun, else one process), "ddp" or "fsdp"."""
    fsdp_state_dict_type: str = "full"
    """FSDP2 checkpoints: "full" (gathered on the main process) or "sharded" (each process writes its shards,
    loadable by any number of processes; mixprec.strategies.dcp_state). HF's SHARDED_STATE_DICT accepted."""
    ddp_timeout: float = 300
    """Seconds a collective waits for every process before the run ends naming the rank that did not answer
    (HF's name; its default is 1800, torch's too: mixprec waits 5 minutes, see mixprec.strategies.peers)."""
    comm_dtype: str | None = None
    """Dtype gradients travel in between processes (HF has no such field): None/"fp32", "bf16" (half the bytes
    per step), "fp16"; DDP communication hooks or FSDP2's reduce_dtype (mixprec.strategies.comm)."""

    # -- precision watch ------------------------------------------------------------------------------
    precision_watch: int | str | dict | None = None
    """Watch each layer's range during the run (mixprec.watch): N (sample every N steps), "watch", "fallback"
    or "fallback:N" (also move a layer that overflows fp16 to fp32), a dict of WatchConfig fields; None: off."""

    def __post_init__(self) -> None:
        if self.output_dir is None:  # HF's default when None is passed
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(self.output_dir)
        self._whole_steps()
        self.check_hf_fields()
        self._hf_rules.merge_eval_alias()
        precision_fields.resolve(self)  # the mode, and the checks that depend on it (step_in_backward, recompute)
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps  # HF's default
        self._hf_rules.apply_implied()
        if self.max_grad_norm == 0:
            self.max_grad_norm = None
        if self.step_in_backward:
            if self.max_grad_norm is not None:
                fail("step_in_backward", True, f"with max_grad_norm={self.max_grad_norm}: {REFUSALS['clip']}")
            if self.gradient_accumulation_steps != 1:
                fail(
                    "step_in_backward",
                    True,
                    f"with gradient_accumulation_steps={self.gradient_accumulation_steps}: {REFUSALS['accumulate']}",
                )
        self.report_to = list(self._normalise_report_to(self.report_to))
        if self.logging_dir is None:
            self.logging_dir = f"{self.output_dir.rstrip('/')}/runs"
        check_positive_int("per_device_train_batch_size", self.per_device_train_batch_size)
        check_positive_int("dataloader_num_workers", self.dataloader_num_workers, allow_zero=True)
        check_choice("distributed", self.distributed, DISTRIBUTED)
        timeout = self.ddp_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            fail("ddp_timeout", self.ddp_timeout, "must be a number of seconds > 0")
        make_comm(self.comm_dtype, f"TrainingArguments(comm_dtype={self.comm_dtype!r})")  # raises naming the field
        WatchConfig.parse(self.precision_watch, f"TrainingArguments(precision_watch={self.precision_watch!r})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            fail("seed", self.seed, "must be an integer")
        self.validate()

    # -- normalisation --------------------------------------------------------------------------------

    def _whole_steps(self) -> None:
        # The step fields are annotated float, as HF's, so HfArgumentParser parses "--save_steps 500" (and
        # "0.1", a ratio); a whole number >= 1 is stored as the int it means, as HF does, so to_dict() and
        # the checkpoint names read 500, not 500.0.
        for name in ("warmup_steps", "eval_steps", "save_steps", "logging_steps"):
            value = getattr(self, name)
            if isinstance(value, float) and value >= 1 and value.is_integer():
                setattr(self, name, int(value))

    @property
    def precision_strategy(self) -> Precision | None:
        """The strategy passed as ``precision=`` (as it is); None for a name, which the Accelerator parses per run."""
        return self._strategy

    @staticmethod
    def _normalise_report_to(value: str | list[str] | None) -> tuple[str, ...]:
        names = [value] if isinstance(value, str) else list(value or [])
        if "none" in names:
            if len(names) > 1:
                fail("report_to", value, "'none' cannot be combined with other reporters")
            return ()
        if "all" in names:
            import importlib.util

            return tuple(n for n in REPORTERS if importlib.util.find_spec(n) is not None)
        return tuple(names)

    # -- grouped views --------------------------------------------------------------------------------

    @property
    def precision_config(self) -> PrecisionConfig:
        """The precision fields as one frozen view (the precision, the loss scaler's knobs), checked."""
        precision_fields.sync(self)  # an edit since construction (args.fp16 = True) is what runs
        return PrecisionConfig(self)

    @property
    def optimization(self) -> OptimConfig:
        """The optimizer's fields as one frozen view (optim, learning rate, betas, clipping...), checked."""
        return OptimConfig(self)

    @property
    def schedule(self) -> ScheduleConfig:
        """The run's length and learning-rate schedule as one frozen view (epochs, max_steps, warmup), checked."""
        return ScheduleConfig(self)

    @property
    def evaluation(self) -> EvalConfig:
        """The evaluation fields as one frozen view (when to evaluate, the best-model metric), checked."""
        return EvalConfig(self)

    @property
    def checkpointing(self) -> CheckpointConfig:
        """The checkpoint fields as one frozen view (when to save, how many to keep), checked."""
        return CheckpointConfig(self)

    @property
    def logging(self) -> LoggingConfig:
        """The logging fields as one frozen view (what is logged, how often, and where), checked."""
        return LoggingConfig(self)

    # -- HF's fields and process helpers: parts built on access, each name delegated --------------------

    @property
    def _hf_rules(self) -> HFFieldRules:
        return HFFieldRules(self)

    @property
    def _processes(self) -> ProcessHelpers:
        return ProcessHelpers.of(self)

    check_hf_fields = delegate("_hf_rules", HFFieldRules.check_hf_fields)
    refuse_unsupported = delegate("_hf_rules", HFFieldRules.refuse_unsupported)
    checkpointing_requested = delegate("_hf_rules", HFFieldRules.checkpointing_requested)
    fsdp_requested = delegate("_hf_rules", HFFieldRules.fsdp_requested)
    fsdp_config_state_dict_type = delegate("_hf_rules", HFFieldRules.fsdp_config_state_dict_type)
    dataloader_configuration = delegate("_hf_rules", HFFieldRules.dataloader_configuration)
    ddp_kwargs = delegate("_hf_rules", HFFieldRules.ddp_kwargs)
    loader_kwargs = delegate("_hf_rules", HFFieldRules.loader_kwargs)

    device = delegate("_processes", ProcessHelpers.device)
    n_gpu = delegate("_processes", ProcessHelpers.n_gpu)
    train_batch_size = delegate("_processes", ProcessHelpers.train_batch_size)
    eval_batch_size = delegate("_processes", ProcessHelpers.eval_batch_size)
    world_size = delegate("_processes", ProcessHelpers.world_size)
    process_index = delegate("_processes", ProcessHelpers.process_index)
    local_process_index = delegate("_processes", ProcessHelpers.local_process_index)
    should_log = delegate("_processes", ProcessHelpers.should_log)
    should_save = delegate("_processes", ProcessHelpers.should_save)
    get_process_log_level = delegate("_processes", ProcessHelpers.get_process_log_level)
    parallel_mode = delegate("_processes", ProcessHelpers.parallel_mode)
    place_model_on_device = delegate("_processes", ProcessHelpers.place_model_on_device)
    main_process_first = delegate("_processes", ProcessHelpers.main_process_first)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup in optimizer steps for a run of ``num_training_steps`` (``warmup_steps``, or the ratio)."""
        return self.schedule.num_warmup_steps(num_training_steps)

    def validate(self) -> None:
        """Validate every group and the rules that span groups. Called at construction and by the Trainer."""
        precision_fields.sync(self)
        self.refuse_unsupported()
        _ = (self.precision_config, self.optimization, self.schedule, self.logging)  # each validates itself
        ev = self.evaluation
        ck = self.checkpointing
        if ck.save_strategy == "best":
            if ev.eval_strategy == "no":
                fail("save_strategy", "best", "needs eval_strategy='steps' or 'epoch' to find the best model")
            if self.metric_for_best_model is None:
                fail("metric_for_best_model", None, "must be set when save_strategy='best' (e.g. 'loss')")
        # save_strategy="best" (checked above) saves every new best: there is always a checkpoint to return to
        if ev.load_best_model_at_end and ck.save_strategy != "best":
            if ev.eval_strategy == "no":
                fail("load_best_model_at_end", True, "needs eval_strategy='steps' or 'epoch' to know the best")
            elif ck.save_strategy != ev.eval_strategy:
                fail(
                    "save_strategy",
                    ck.save_strategy,
                    f"must equal eval_strategy={ev.eval_strategy!r} when load_best_model_at_end=True, so every "
                    "evaluated model has a checkpoint to return to",
                )
            elif ev.eval_strategy == "steps" and _not_a_multiple(ck.save_steps, ev.eval_steps):
                fail(
                    "save_steps",
                    ck.save_steps,
                    f"must be a multiple of eval_steps={ev.eval_steps} when load_best_model_at_end=True",
                )
        if self.metric_for_best_model is not None and ev.eval_strategy == "no":
            fail("metric_for_best_model", self.metric_for_best_model, "needs eval_strategy='steps' or 'epoch'")

    # -- serialisation --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: a torch.dtype (in a subclass's field) becomes its name, as in HF."""
        return {f.name: _plain_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_sanitized_dict(self) -> dict[str, Any]:
        """The arguments for TensorBoard's hparams, as HF: numbers, strings and bools kept, the rest as str."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}

    def to_json_string(self) -> str:
        """:meth:`to_dict` as indented JSON, keys sorted (as HF)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainingArguments:
        """Rebuild from :meth:`to_dict` (fields that are not constructor arguments are skipped)."""
        values = {k: v for k, v in values.items() if k not in _NOT_INIT}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"TrainingArguments has no field(s) {', '.join(unknown)}")
        return cls(**values)


_NOT_INIT = {f.name for f in dataclasses.fields(TrainingArguments) if not f.init}


def _not_a_multiple(save_steps: float, eval_steps: float) -> bool:
    # HF: ratios can only be compared with ratios; a whole number of eval intervals per save otherwise.
    if save_steps < 1 or eval_steps < 1:
        ratio = save_steps / eval_steps
        return not (save_steps < 1 and eval_steps < 1 and math.isclose(ratio, round(ratio)))
    return save_steps % eval_steps != 0


def _plain_value(value: Any) -> Any:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
