"""Hugging Face ``TrainingArguments`` fields beyond the ones mixprec's own groups hold, so any HF script's
arguments construct unchanged (transformers 5.24: 114 fields).

Each field here says what mixprec does with it, in its help text (``"<policy>: <note>"``, the only metadata key,
because ``HfArgumentParser`` passes every metadata key to argparse's ``add_argument``; :data:`POLICY` holds the
same, parsed, for the docs and the checks):

- ``implemented``: honoured (the note says where);
- ``ignored``: accepted and without effect, because ignoring it cannot change what is trained (a Hub upload
  setting, a log verbosity, a memory-hygiene knob); the note says why it is harmless;
- ``refused``: accepted at its default; any other value raises a ValueError naming the field, because silently
  ignoring it would train something other than what the script asked for.

The fields are keyword-only, so ``TrainingArguments("out")`` still takes ``output_dir`` first, as HF's does.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
"""HF's ``log_level`` names ("passive": the logger's level is left as the application set it)."""


def _f(default: Any, kind: str, note: str) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": f"{kind}: {note}"})
    return field(default=default, metadata={"help": f"{kind}: {note}"})


_HUB = "only read when pushing to the Hub, which mixprec refuses (push_to_hub)"
_DDP = "passed to DistributedDataParallel (Accelerator ddp_kwargs) when set"
_LOADER = "passed to the DataLoader (needs dataloader_num_workers > 0, as in torch)"


@dataclass(kw_only=True)
class HFCompatFields:
    """HF-only fields; see the module docstring for the three policies."""

    # -- implemented -----------------------------------------------------------------------------------
    fsdp_config: dict[str, Any] | str | None = _f(
        None, IMPLEMENTED, "only its state_dict_type (FULL_STATE_DICT / SHARDED_STATE_DICT): fsdp_state_dict_type"
    )
    activation_checkpointing: bool | None = _f(
        None, IMPLEMENTED, "model.activation_checkpointing_enable()/gradient_checkpointing_enable(), or mixprec's GPT"
    )
    activation_checkpointing_kwargs: dict[str, Any] | None = _f(
        None, IMPLEMENTED, "passed to the model's *_checkpointing_enable(gradient_checkpointing_kwargs=...)"
    )
    gradient_checkpointing: bool | None = _f(None, IMPLEMENTED, "HF 5's deprecated alias of activation_checkpointing")
    gradient_checkpointing_kwargs: dict[str, Any] | None = _f(
        None, IMPLEMENTED, "HF 5's deprecated alias of activation_checkpointing_kwargs"
    )
    accelerator_config: dict[str, Any] | str | None = _f(
        None,
        IMPLEMENTED,
        "its DataLoader keys (dispatch_batches, even_batches, use_seedable_sampler, non_blocking; split_batches "
        "refused): Accelerator(dataloader_config=...); its other keys only at their defaults",
    )
    skip_memory_metrics: bool = _f(
        True, IMPLEMENTED, "False: <stage>_mem_cpu/gpu_alloc/peaked_delta in the train/eval/predict metrics"
    )
    neftune_noise_alpha: float | None = _f(
        None, IMPLEMENTED, "NEFTune: noise on model.get_input_embeddings()'s output while training"
    )
    include_num_input_tokens_seen: str | bool = _f(
        "no",
        IMPLEMENTED,
        "'all' / True (input_ids elements) or 'non_padding' (attention_mask sum): state.num_input_tokens_seen, "
        "summed over processes, and in each training log entry",
    )
    log_level: str = _f(
        "passive", IMPLEMENTED, "the 'mixprec' logger's level on the main process ('passive': left as it is)"
    )
    log_level_replica: str = _f("warning", IMPLEMENTED, "the 'mixprec' logger's level on the other processes")
    eval_on_start: bool = _f(False, IMPLEMENTED, "one evaluation before the first step")
    eval_delay: float = _f(0, IMPLEMENTED, "no evaluation before this many steps (or epochs, by eval_strategy)")
    tf32: bool | None = _f(None, IMPLEMENTED, "sets torch.backends.cuda.matmul/cudnn.allow_tf32 (CUDA only)")
    torch_compile_backend: str | None = _f(None, IMPLEMENTED, "model.compile(backend=...); implies torch_compile")
    torch_compile_mode: str | None = _f(None, IMPLEMENTED, "model.compile(mode=...); implies torch_compile")
    full_determinism: bool = _f(False, IMPLEMENTED, "torch.use_deterministic_algorithms(True) and seeded RNGs")
    dataloader_pin_memory: bool = _f(True, IMPLEMENTED, "DataLoader(pin_memory=...) when CUDA is present")
    dataloader_persistent_workers: bool = _f(False, IMPLEMENTED, _LOADER)
    dataloader_prefetch_factor: int | None = _f(None, IMPLEMENTED, _LOADER)
    dataloader_multiprocessing_context: str | None = _f(None, IMPLEMENTED, _LOADER)
    dataloader_in_order: bool = _f(True, IMPLEMENTED, "DataLoader(in_order=...)")
    train_sampling_strategy: str = _f(
        "random", IMPLEMENTED, "'random' (shuffled) or 'sequential'; 'group_by_length' is refused"
    )
    ddp_find_unused_parameters: bool | None = _f(None, IMPLEMENTED, _DDP)
    ddp_bucket_cap_mb: int | None = _f(None, IMPLEMENTED, _DDP)
    ddp_broadcast_buffers: bool | None = _f(None, IMPLEMENTED, _DDP)
    ddp_static_graph: bool | None = _f(None, IMPLEMENTED, _DDP)
    fsdp: str | None = _f(  # also a list of options or True, as HF's; annotated as HF's for HfArgumentParser
        None, IMPLEMENTED, "'full_shard' (optionally 'auto_wrap') selects distributed='fsdp'; other options refused"
    )
    restore_callback_states_from_checkpoint: bool = _f(
        False, IMPLEMENTED, "stateful callbacks (ExportableState) are rebuilt from the checkpoint on resume"
    )
    batch_eval_metrics: bool = _f(False, IMPLEMENTED, "compute_metrics(..., compute_result=) after every batch")
    do_eval: bool = _f(False, IMPLEMENTED, "as HF: set True when eval_strategy != 'no'; not read by the Trainer")

    # -- ignored (harmless) ----------------------------------------------------------------------------
    do_train: bool = _f(False, IGNORED, "HF's Trainer does not read it either (it is for user scripts)")
    do_predict: bool = _f(False, IGNORED, "HF's Trainer does not read it either (it is for user scripts)")
    resume_from_checkpoint: str | None = _f(
        None, IGNORED, "HF's Trainer does not read it either: pass train(resume_from_checkpoint=...)"
    )
    local_rank: int = _f(-1, IGNORED, "the process rank comes from torchrun's environment (LOCAL_RANK)")
    average_tokens_across_devices: bool = _f(
        True,
        IGNORED,
        "losses are per-batch means averaged over batches and processes (HF's rule for models "
        "that take no num_items_in_batch)",
    )
    eval_accumulation_steps: int | None = _f(
        None, IGNORED, "predictions already move to the host after every batch (eval_accumulation_steps=1)"
    )
    log_on_each_node: bool = _f(True, IGNORED, "only the main process logs")
    logging_nan_inf_filter: bool = _f(
        True, IMPLEMENTED, "a skipped step's inf/NaN loss is left out of the logged and summary means"
    )
    torch_empty_cache_steps: int | None = _f(None, IGNORED, "a memory-hygiene knob; the allocator caches as usual")
    use_cache: bool = _f(False, IGNORED, "the model's KV cache setting is left as the model has it")
    length_column_name: str = _f("length", IGNORED, "only read by train_sampling_strategy='group_by_length'")
    ignore_data_skip: bool = _f(False, IGNORED, "a resume always restarts at the exact batch, at no cost")
    enable_jit_checkpoint: bool = _f(False, IGNORED, "mixprec always checkpoints on SIGTERM")
    project: str = _f("huggingface", IGNORED, "only read by report_to='trackio'")
    trackio_space_id: str | None = _f(None, IGNORED, "only read by report_to='trackio'")
    trackio_bucket_id: str | None = _f(None, IGNORED, "only read by report_to='trackio'")
    trackio_static_space_id: str | None = _f(None, IGNORED, "only read by report_to='trackio'")
    hub_token: str | None = _f(None, IGNORED, _HUB)
    hub_private_repo: bool | None = _f(None, IGNORED, _HUB)
    hub_model_id: str | None = _f(None, IGNORED, _HUB)
    hub_strategy: str = _f("every_save", IGNORED, _HUB)
    hub_always_push: bool = _f(False, IGNORED, _HUB)
    hub_revision: str | None = _f(None, IGNORED, _HUB)

    # -- refused unless at their default ---------------------------------------------------------------
    eval_do_concat_batches: bool = _f(True, REFUSED, "predictions are always concatenated across batches")
    save_on_each_node: bool = _f(False, REFUSED, "checkpoints are written by the main process to a shared folder")
    push_to_hub: bool = _f(False, REFUSED, "mixprec does not upload; push the saved folder with huggingface_hub")
    label_smoothing_factor: float = _f(
        0.0, REFUSED, "not implemented: override compute_loss with F.cross_entropy(..., label_smoothing=...)"
    )
    bf16_full_eval: bool = _f(False, REFUSED, "evaluation runs under the training precision (autocast, fp32 master)")
    fp16_full_eval: bool = _f(False, REFUSED, "evaluation runs under the training precision (autocast, fp32 master)")
    lr_scheduler_kwargs: dict[str, Any] | None = _f(None, REFUSED, "the schedules take no extra arguments")
    optim_target_modules: None | str | list[str] = _f(None, REFUSED, "GaLore-style optimizers are not built in")
    use_liger_kernel: bool = _f(False, REFUSED, "Liger kernels are not applied")
    liger_kernel_config: dict[str, bool] | None = _f(None, REFUSED, "Liger kernels are not applied")
    auto_find_batch_size: bool = _f(False, REFUSED, "no retry on out-of-memory: lower per_device_train_batch_size")
    eval_use_gather_object: bool = _f(False, REFUSED, "evaluation gathers tensors only")
    include_for_metrics: list[str] = _f([], REFUSED, "EvalPrediction carries predictions and label_ids only")
    save_only_model: bool = _f(False, REFUSED, "checkpoints hold the full state so a resume is exact")
    parallelism_config: Any = _f(None, REFUSED, "tensor/context parallelism is not implemented")
    ddp_backend: str | None = _f(None, REFUSED, "the backend follows the device (nccl on CUDA, gloo on CPU)")
    deepspeed: dict[str, Any] | str | None = _f(None, REFUSED, "DeepSpeed is not supported; use distributed='fsdp'")
    debug: str | list[str] = _f("", REFUSED, "run `mixprec diagnose` for underflow/overflow diagnosis")

    def check_hf_fields(self) -> None:
        """Refuse a non-default value of a ``refused`` field; apply HF's aliases and implied settings."""
        from mixprec.trainer.configs import fail  # the one error format for TrainingArguments

        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", "lr_scheduler_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("{"):  # HF parses JSON strings (command lines)
                setattr(self, name, json.loads(value))
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        for name in ("log_level", "log_level_replica"):
            if getattr(self, name) not in LOG_LEVELS:
                fail(name, getattr(self, name), f"choose one of: {', '.join(map(repr, LOG_LEVELS))}")
        if self.include_num_input_tokens_seen not in ("no", "all", "non_padding"):
            fail("include_num_input_tokens_seen", self.include_num_input_tokens_seen,
                 "choose 'all' (or True), 'non_padding' or 'no' (or False)")  # fmt: skip
        steps = self.torch_empty_cache_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            fail("torch_empty_cache_steps", steps, "must be a positive integer or None")
        self.refuse_unsupported()
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):  # HF 5: the old names are aliases; once resolved both read the same
            if getattr(self, new) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False
        if self.train_sampling_strategy not in ("random", "sequential"):
            fail(
                "train_sampling_strategy",
                self.train_sampling_strategy,
                "choose 'random' or 'sequential' (group_by_length is not implemented)",
            )
        alpha = self.neftune_noise_alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
            fail("neftune_noise_alpha", alpha, "must be a number > 0 (HF's papers use 5 to 15), or None")
        if not (isinstance(self.eval_delay, (int, float)) and self.eval_delay >= 0):
            fail("eval_delay", self.eval_delay, "must be a number >= 0")

    def refuse_unsupported(self) -> None:
        """A ValueError naming the first ``refused`` field set to anything but its default (also run by
        ``validate()``, so a field edited after construction is caught before training)."""
        from mixprec.trainer.configs import fail

        for f in fields(HFCompatFields):
            if POLICY.get(f.name, ("",))[0] != REFUSED:
                continue
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
            value = getattr(self, f.name)
            if value != default and not (value in (None, "", []) and default in (None, "", [])):
                fail(f.name, value, f"is not supported by mixprec ({POLICY[f.name][1]}); leave it at {default!r}")

    def checkpointing_requested(self) -> tuple[bool, dict[str, Any] | None]:
        """Whether to turn on activation checkpointing, and its kwargs. Either name counts, so a script that
        sets ``args.gradient_checkpointing = True`` after construction is honoured (HF 5 would ignore it)."""
        on = bool(self.activation_checkpointing or self.gradient_checkpointing)
        return on, self.activation_checkpointing_kwargs or self.gradient_checkpointing_kwargs

    def fsdp_requested(self) -> bool:
        """Whether HF's ``fsdp`` field asks for plain full sharding (mixprec's distributed='fsdp')."""
        value = self.fsdp
        if value in (None, False, "", []):
            return False
        if value is True:
            return True
        options = value.split() if isinstance(value, str) else list(value)
        unsupported = [o for o in options if o not in ("full_shard", "auto_wrap")]
        if unsupported or "full_shard" not in options:
            from mixprec.trainer.configs import fail

            fail("fsdp", value, "mixprec shards fully (FSDP2): use 'full_shard' (optionally with 'auto_wrap')")
        return True

    def fsdp_config_state_dict_type(self) -> str | None:
        """The checkpoint type HF's ``fsdp_config`` asks for (a dict, or the path of a JSON file holding one),
        None when it names none. Its other keys (wrapping policies, prefetching, XLA) are refused by name."""
        config = _config_dict("fsdp_config", self.fsdp_config)
        if config is None:
            return None
        from mixprec.trainer.configs import fail

        found = {k: v for k, v in config.items() if k in ("state_dict_type", "fsdp_state_dict_type")}
        others = sorted(set(config) - set(found))
        if others:
            why = (f"mixprec reads only its state_dict_type; {', '.join(others)} is not supported (FSDP2 shards "
                   "each ModuleList member and the root: Accelerator(fsdp_shard=...))")  # fmt: skip
            fail("fsdp_config", config, why)
        if len(set(found.values())) > 1:
            fail("fsdp_config", config, "state_dict_type and fsdp_state_dict_type disagree")
        return next(iter(found.values()), None)

    def dataloader_configuration(self) -> Any:
        """The :class:`~mixprec.loaders.data_config.DataLoaderConfiguration` HF's ``accelerator_config`` (a
        dict, HF's AcceleratorConfig, or the path of a JSON file) asks for; None when it is unset."""
        config = _config_dict("accelerator_config", self.accelerator_config)
        if config is None:
            return None
        from mixprec.loaders.data_config import DataLoaderConfiguration
        from mixprec.trainer.configs import fail

        keys = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking")
        others = sorted(k for k, v in config.items() if k not in keys and v not in (None, False, {}))
        if others:
            fail(
                "accelerator_config",
                config,
                f"mixprec reads only its DataLoader keys ({', '.join(keys)}); {', '.join(others)} is not supported",
            )
        try:
            return DataLoaderConfiguration(**{k: config[k] for k in keys if k in config})
        except ValueError as err:
            fail("accelerator_config", config, str(err))

    def ddp_kwargs(self) -> dict[str, Any]:
        """The ``ddp_*`` fields that were set, as DistributedDataParallel's keyword arguments."""
        names = {
            "ddp_find_unused_parameters": "find_unused_parameters",
            "ddp_bucket_cap_mb": "bucket_cap_mb",
            "ddp_broadcast_buffers": "broadcast_buffers",
            "ddp_static_graph": "static_graph",
        }
        return {kw: getattr(self, name) for name, kw in names.items() if getattr(self, name) is not None}

    def loader_kwargs(self) -> dict[str, Any]:
        """DataLoader keyword arguments from the ``dataloader_*`` fields (worker-only ones only with workers,
        as torch refuses them otherwise)."""
        import torch

        kwargs: dict[str, Any] = {"pin_memory": bool(self.dataloader_pin_memory and torch.cuda.is_available())}
        if self.dataloader_num_workers > 0:  # type: ignore[attr-defined]
            kwargs["persistent_workers"] = self.dataloader_persistent_workers
            kwargs["in_order"] = self.dataloader_in_order
            if self.dataloader_prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.dataloader_prefetch_factor
            if self.dataloader_multiprocessing_context is not None:
                kwargs["multiprocessing_context"] = self.dataloader_multiprocessing_context
        return kwargs


def _config_dict(name: str, config: Any) -> dict[str, Any] | None:
    """HF's config fields as a dict: given as one, as an HF config dataclass, or as the path of a JSON file
    holding one; None when unset."""
    if config in (None, {}, ""):
        return None
    if isinstance(config, str):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    elif not isinstance(config, dict) and hasattr(config, "__dataclass_fields__"):  # HF's AcceleratorConfig
        config = {key: getattr(config, key) for key in config.__dataclass_fields__}
    if not isinstance(config, dict):
        from mixprec.trainer.configs import fail

        fail(name, config, "must be a dict or the path of a JSON file holding one")
    return config


POLICY: dict[str, tuple[str, str]] = {
    f.name: tuple(f.metadata["help"].split(": ", 1)) for f in fields(HFCompatFields) if "help" in f.metadata
}  # type: ignore[misc]
"""field name -> (policy, note), for the docs and the tests."""
