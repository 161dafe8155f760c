"""What HF's fields mean for a run: the checks, aliases and implied settings of a ``TrainingArguments``' HF
fields (:mod:`mixprec.trainer.hf_fields`), and the keyword arguments they become for the Accelerator, DDP and
the DataLoaders.

:class:`HFFieldRules` is a part of :class:`~mixprec.trainer.args.TrainingArguments`, which delegates those
names to it (``args.ddp_kwargs()`` is ``args._hf_rules.ddp_kwargs()``). It is built on access over the
arguments themselves, not a copy: the aliases and implied settings are written back into them, as HF's
``__post_init__`` does.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

import torch

from mixprec.accelerator.config import parse_state_dict_type
from mixprec.loaders.data_config import DataLoaderConfiguration
from mixprec.trainer.configs import fail
from mixprec.trainer.hf_fields import LOG_LEVELS, POLICY, REFUSED, HFCompatFields


class HFFieldRules:
    """The rules of HF's fields over one TrainingArguments (see the module doc)."""

    def __init__(self, args: Any) -> None:
        self.args = args  # a TrainingArguments (not imported: args.py imports this module)

    def merge_eval_alias(self) -> None:
        """HF 4's ``evaluation_strategy``: an alias of ``eval_strategy``, merged into it (one source of truth)."""
        alias = self.args.evaluation_strategy
        if alias is None:
            return
        if self.args.eval_strategy != "no" and self.args.eval_strategy != alias:
            fail(
                "evaluation_strategy",
                alias,
                f"conflicts with eval_strategy={self.args.eval_strategy!r}; they are the same setting, set only "
                "eval_strategy",
            )
        self.args.eval_strategy = alias
        self.args.evaluation_strategy = None  # one source of truth from here on

    def apply_implied(self) -> None:
        """HF's derived settings, so scripts that rely on them behave the same."""
        args = self.args
        if args.eval_strategy != "no":
            args.do_eval = True
        # load_best_model_at_end compares checkpoints by a metric: HF picks the eval loss, minimised, and
        # EarlyStoppingCallback needs both filled in.
        if args.load_best_model_at_end and args.metric_for_best_model is None:
            args.metric_for_best_model = "loss"
        if args.greater_is_better is None and args.metric_for_best_model is not None:
            args.greater_is_better = not args.metric_for_best_model.endswith("loss")
        if args.torch_compile_backend is not None or args.torch_compile_mode is not None:
            args.torch_compile = True
        if args.torch_compile and args.torch_compile_backend is None:
            args.torch_compile_backend = "inductor"  # torch.compile's default, named as HF does
        if args.use_cpu:
            args.dataloader_pin_memory = False  # as HF: nothing to pin for on the CPU
        if args.dataloader_prefetch_factor is not None and args.dataloader_num_workers == 0:
            fail("dataloader_prefetch_factor", args.dataloader_prefetch_factor, "needs dataloader_num_workers > 0")
        if self.fsdp_requested():
            if args.distributed not in (None, "fsdp"):
                fail("fsdp", args.fsdp, f"conflicts with distributed={args.distributed!r}; set one of them")
            args.distributed = "fsdp"
        self.dataloader_configuration()  # HF's accelerator_config: checked here, used by the Accelerator
        from_config = self.fsdp_config_state_dict_type()  # HF's fsdp_config={"state_dict_type": ...}
        if from_config is not None:
            wanted = parse_state_dict_type(from_config, args.distributed, "TrainingArguments(fsdp_config=...)")
            if args.fsdp_state_dict_type not in ("full", wanted):
                fail(
                    "fsdp_config",
                    args.fsdp_config,
                    f"conflicts with fsdp_state_dict_type={args.fsdp_state_dict_type!r}",
                )
            args.fsdp_state_dict_type = wanted
        args.fsdp_state_dict_type = parse_state_dict_type(
            args.fsdp_state_dict_type, args.distributed, "TrainingArguments"
        )
        if args.async_save and args.fsdp_state_dict_type == "sharded":  # up front, not at the first save
            fail(
                "async_save",
                True,
                "is not supported with fsdp_state_dict_type='sharded' (DCP shards are written "
                "synchronously); set async_save=False, or use full state dicts",
            )
        if args.tf32 is not None:  # process-wide, as HF sets it (only CUDA matmuls read it)
            torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
            torch.backends.cudnn.allow_tf32 = bool(args.tf32)

    def check_hf_fields(self) -> None:
        """Refuse a non-default value of a ``refused`` field; apply HF's aliases and implied settings."""
        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", "lr_scheduler_kwargs"):
            value = getattr(self.args, name)
            if isinstance(value, str) and value.startswith("{"):  # HF parses JSON strings (command lines)
                setattr(self.args, name, json.loads(value))
        if isinstance(self.args.include_num_input_tokens_seen, bool):
            self.args.include_num_input_tokens_seen = "all" if self.args.include_num_input_tokens_seen else "no"
        for name in ("log_level", "log_level_replica"):
            if getattr(self.args, name) not in LOG_LEVELS:
                fail(name, getattr(self.args, name), f"choose one of: {', '.join(map(repr, LOG_LEVELS))}")
        if self.args.include_num_input_tokens_seen not in ("no", "all", "non_padding"):
            fail(
                "include_num_input_tokens_seen",
                self.args.include_num_input_tokens_seen,
                "choose 'all' (or True), 'non_padding' or 'no' (or False)",
            )
        steps = self.args.torch_empty_cache_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            fail("torch_empty_cache_steps", steps, "must be a positive integer or None")
        self.refuse_unsupported()
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):  # HF 5: the old names are aliases; once resolved both read the same
            if getattr(self.args, new) is None and getattr(self.args, old) is not None:
                setattr(self.args, new, getattr(self.args, old))
            setattr(self.args, old, getattr(self.args, new))
        if self.args.activation_checkpointing is None:
            self.args.activation_checkpointing = self.args.gradient_checkpointing = False
        if self.args.train_sampling_strategy not in ("random", "sequential"):
            fail(
                "train_sampling_strategy",
                self.args.train_sampling_strategy,
                "choose 'random' or 'sequential' (group_by_length is not implemented)",
            )
        alpha = self.args.neftune_noise_alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
            fail("neftune_noise_alpha", alpha, "must be a number > 0 (HF's papers use 5 to 15), or None")
        if not (isinstance(self.args.eval_delay, (int, float)) and self.args.eval_delay >= 0):
            fail("eval_delay", self.args.eval_delay, "must be a number >= 0")

    def refuse_unsupported(self) -> None:
        """A ValueError naming the first ``refused`` field set to anything but its default (also run by
        ``validate()``, so a field edited after construction is caught before training)."""
        for f in fields(HFCompatFields):
            if POLICY.get(f.name, ("",))[0] != REFUSED:
                continue
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
            value = getattr(self.args, f.name)
            if value != default and not (value in (None, "", []) and default in (None, "", [])):
                fail(f.name, value, f"is not supported by mixprec ({POLICY[f.name][1]}); leave it at {default!r}")

    def checkpointing_requested(self) -> tuple[bool, dict[str, Any] | None]:
        """Whether to turn on activation checkpointing, and its kwargs. Either name counts, so a script that
        sets ``args.gradient_checkpointing = True`` after construction is honoured (HF 5 would ignore it)."""
        on = bool(self.args.activation_checkpointing or self.args.gradient_checkpointing)
        return on, self.args.activation_checkpointing_kwargs or self.args.gradient_checkpointing_kwargs

    def fsdp_requested(self) -> bool:
        """Whether HF's ``fsdp`` field asks for plain full sharding (mixprec's distributed='fsdp')."""
        value = self.args.fsdp
        if value in (None, False, "", []):
            return False
        if value is True:
            return True
        options = value.split() if isinstance(value, str) else list(value)
        unsupported = [o for o in options if o not in ("full_shard", "auto_wrap")]
        if unsupported or "full_shard" not in options:
            fail("fsdp", value, "mixprec shards fully (FSDP2): use 'full_shard' (optionally with 'auto_wrap')")
        return True

    def fsdp_config_state_dict_type(self) -> str | None:
        """The checkpoint type HF's ``fsdp_config`` asks for (a dict, or the path of a JSON file holding one),
        None when it names none. Its other keys (wrapping policies, prefetching, XLA) are refused by name."""
        config = _config_dict("fsdp_config", self.args.fsdp_config)
        if config is None:
            return None
        found = {k: v for k, v in config.items() if k in ("state_dict_type", "fsdp_state_dict_type")}
        others = sorted(set(config) - set(found))
        if others:
            why = (
                f"mixprec reads only its state_dict_type; {', '.join(others)} is not supported (FSDP2 shards "
                "each ModuleList member and the root: Accelerator(fsdp_shard=...))"
            )
            fail("fsdp_config", config, why)
        if len(set(found.values())) > 1:
            fail("fsdp_config", config, "state_dict_type and fsdp_state_dict_type disagree")
        return next(iter(found.values()), None)

    def dataloader_configuration(self) -> Any:
        """The :class:`~mixprec.loaders.data_config.DataLoaderConfiguration` HF's ``accelerator_config`` (a
        dict, HF's AcceleratorConfig, or the path of a JSON file) asks for; None when it is unset."""
        config = _config_dict("accelerator_config", self.args.accelerator_config)
        if config is None:
            return None
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
        """The ``ddp_*`` fields that were set, as DistributedDataParallel's keyword arguments (the names less
        their prefix)."""
        names = ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")
        return {n.removeprefix("ddp_"): getattr(self.args, n) for n in names if getattr(self.args, n) is not None}

    def loader_kwargs(self) -> dict[str, Any]:
        """DataLoader keyword arguments from the ``dataloader_*`` fields (worker-only ones only with workers,
        as torch refuses them otherwise)."""
        kwargs: dict[str, Any] = {"pin_memory": bool(self.args.dataloader_pin_memory and torch.cuda.is_available())}
        if self.args.dataloader_num_workers > 0:  # type: ignore[attr-defined]
            kwargs["persistent_workers"] = self.args.dataloader_persistent_workers
            kwargs["in_order"] = self.args.dataloader_in_order
            if self.args.dataloader_prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.args.dataloader_prefetch_factor
            if self.args.dataloader_multiprocessing_context is not None:
                kwargs["multiprocessing_context"] = self.args.dataloader_multiprocessing_context
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
        fail(name, config, "must be a dict or the path of a JSON file holding one")
    return config
