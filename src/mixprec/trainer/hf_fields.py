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
:class:`HFCompatFields` holds fields only, inherited by ``TrainingArguments`` because ``HfArgumentParser``,
``dataclasses.fields`` and ``TrainingArguments(fsdp=...)`` see a dataclass's own and inherited fields, never
those of an object it holds; what the fields mean is :mod:`mixprec.trainer.hf_field_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
"""HF's ``log_level`` names ("passive": the logger's level is left as the application set it)."""


def _f(default: Any, kind: str, note: str, bare: bool = False) -> Any:
    """A field and its help; ``bare``: a flag given alone on a command line means True (HF's nargs="?", const)."""
    metadata = {"help": f"{kind}: {note}", **({"nargs": "?", "const": True} if bare else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


_HUB = "only read when pushing to the Hub, which mixprec refuses (push_to_hub)"
_DDP = "passed to DistributedDataParallel (Accelerator ddp_kwargs) when set"
_LOADER = "passed to the DataLoader (needs dataloader_num_workers > 0, as in torch)"


@dataclass(kw_only=True)
class HFCompatFields:
    """HF-only fields (fields only: see the module docstring for the three policies)."""

    # -- implemented -----------------------------------------------------------------------------------
    fsdp_config: dict[str, Any] | str | None = _f(
        None, IMPLEMENTED, "only its state_dict_type (FULL_STATE_DICT / SHARDED_STATE_DICT): fsdp_state_dict_type"
    )
    activation_checkpointing: bool | None = _f(
        None,
        IMPLEMENTED,
        "model.activation_checkpointing_enable()/gradient_checkpointing_enable(), or mixprec's GPT",
        bare=True,
    )
    # the kwargs fields take a JSON string too, as HF's (a command line: --gradient_checkpointing_kwargs '{...}')
    activation_checkpointing_kwargs: dict[str, Any] | str | None = _f(
        None, IMPLEMENTED, "passed to the model's *_checkpointing_enable(gradient_checkpointing_kwargs=...)"
    )
    gradient_checkpointing: bool | None = _f(
        None, IMPLEMENTED, "HF 5's deprecated alias of activation_checkpointing", bare=True
    )
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = _f(
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
        None,
        IMPLEMENTED,
        "'full_shard' (optionally 'auto_wrap') selects distributed='fsdp'; other options refused",
        bare=True,
    )
    restore_callback_states_from_checkpoint: bool = _f(
        False, IMPLEMENTED, "stateful callbacks (ExportableState) are rebuilt from the checkpoint on resume"
    )
    batch_eval_metrics: bool = _f(False, IMPLEMENTED, "compute_metrics(..., compute_result=) after every batch")
    do_eval: bool = _f(False, IMPLEMENTED, "as HF: set True when eval_strategy != 'no'; not read by the Trainer")
    average_tokens_across_devices: bool = _f(
        True,
        IMPLEMENTED,
        "with compute_loss_func: num_items_in_batch counts every process's label tokens, and the loss is multiplied "
        "by the processes (HF's rule); a model's own loss stays a per-batch mean",
    )

    # -- ignored (harmless) ----------------------------------------------------------------------------
    do_train: bool = _f(False, IGNORED, "HF's Trainer does not read it either (it is for user scripts)")
    do_predict: bool = _f(False, IGNORED, "HF's Trainer does not read it either (it is for user scripts)")
    resume_from_checkpoint: str | None = _f(
        None, IGNORED, "HF's Trainer does not read it either: pass train(resume_from_checkpoint=...)"
    )
    local_rank: int = _f(-1, IGNORED, "the process rank comes from torchrun's environment (LOCAL_RANK)")
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
    lr_scheduler_kwargs: dict[str, Any] | str | None = _f(None, REFUSED, "the schedules take no extra arguments")
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


POLICY: dict[str, tuple[str, str]] = {
    f.name: tuple(f.metadata["help"].split(": ", 1)) for f in fields(HFCompatFields) if "help" in f.metadata
}  # type: ignore[misc]
"""field name -> (policy, note), for the docs and the tests."""
