"""Optimizer creation: the optimizer and learning-rate schedule a Trainer builds when the user passes none.

:func:`build_optimizer` puts the model's trainable parameters in two groups, weight decay only on tensors with two
or more dimensions (matrices and embeddings), never on biases and norm gains, as nanoGPT and HF both do, and
builds the optimizer ``args.optim`` names (AdamW by default). :func:`build_scheduler` builds HF's schedules (and
nanoGPT's, ``"nanogpt_cosine"``) as ``LambdaLR`` over picklable-free ``functools.partial`` objects, so the
scheduler's state dict is plain numbers (saved as JSON). Both read a grouped view of TrainingArguments
(``args.optimization``, ``args.schedule``).

The optimizers ``TrainingArguments(optim=...)`` names: Hugging Face's names and meanings, in one table.

==========================  =========================================================  ===========================
``optim``                   what it builds                                             bytes / param (states)
==========================  =========================================================  ===========================
``adamw_torch``             ``torch.optim.AdamW``, fused where torch has the kernel    8 (fp32 moments)
``adamw_torch_fused``       the same, the fused kernel required                        8
``adamw_torch_8bit``        torchao ``AdamW8bit``: moments quantised in blocks         ~2 (+ fp32 for small tensors)
``adamw_torch_4bit``        torchao ``AdamW4bit``                                      ~1 (+ fp32 for small tensors)
``adamw_anyprecision``      :class:`~mixprec.optim.AnyPrecisionAdamW`                  4 with bf16 moments
``sgd``                     ``torch.optim.SGD``                                        0 (4 with momentum)
==========================  =========================================================  ===========================

``adamw_torch`` runs torch's fused kernel where torch has one for every parameter's device and dtype (CPU,
CUDA, MPS, XPU: issue 36), and torch's default implementation otherwise (foreach on CUDA, the single-tensor
loop elsewhere). torch's own default on a CPU is the single-tensor loop: 2.2 ms a step on ``mixprec train``'s
model against the fused kernel's 0.45 ms. The fused kernel is not bit-identical to the loop (it rounds
``lr * m / (sqrt(v) + eps)`` in another order: parameters within ~1e-6 relative after a step);
``optim_args="fused=False"`` keeps torch's default implementation.

``optim_args`` is HF's "key=value,key=value" string; each optimizer accepts the keys HF's Trainer reads for it
(8/4-bit: ``block_size``, ``bf16_stochastic_round``; anyprecision: ``use_kahan_summation``,
``momentum_dtype``, ``variance_dtype``, ``compensation_buffer_dtype``; sgd: ``momentum``, ``dampening``,
``nesterov``), with HF's defaults. Unlike HF, an unknown key is an error (a typo would otherwise be ignored).

Small tensors in the 8/4-bit optimizers: torchao quantises a moment only when its tensor has >= 4096 elements
and a multiple of ``block_size`` (bitsandbytes' rule); biases, norm gains and odd shapes keep plain moments in
the parameter's dtype. On a GPT that is well under 1% of the parameters. Each block of ``block_size`` values
also keeps an fp32 scale: with HF's default 256 that is 0.03 bytes per parameter for the two moments, with
``optim_args="block_size=2048"`` (the block of bitsandbytes' 8-bit optimizers) 0.004 (benchmarks/bench_lean.py:
6.04 against 6.01 bytes per parameter in all under ``bf16-pure`` on the 25M-parameter GPT).

The 8/4-bit step is ``torch.compile``d per parameter shape by torchao: the first step compiles (about 3 min
for the 8-bit and 1.5 min for the 4-bit optimizer on the 25M-parameter GPT on the 2-core dev box; inductor
caches it on disk for the next run). On a CPU the steps after it are still ~7x (8-bit) and ~11x (4-bit) slower
than torch's AdamW (benchmarks/bench_lean.py): they trade optimizer time for memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from mixprec.optim.anyprecision import AnyPrecisionAdamW
from mixprec.precision.torchao_extra import import_torchao

_TRUE = ("y", "yes", "t", "true", "on", "1")  # HF's strtobool
_FALSE = ("n", "no", "f", "false", "off", "0")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("must be True or False")


def _dtype(text: str) -> torch.dtype:
    if text not in _DTYPES:
        raise ValueError(f"must be one of {', '.join(_DTYPES)}")
    return _DTYPES[text]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be a positive integer")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


# optim name -> {optim_args key: (parser, default)}; the defaults are HF's
_LOW_BIT = {"block_size": (_positive_int, 256), "bf16_stochastic_round": (_bool, False)}
OPTIM_ARGS: dict[str, dict[str, tuple[Callable[[str], Any], Any]]] = {
    "adamw_torch": {"fused": (_bool, None)},  # None: where torch has the kernel for the parameters
    "adamw_torch_fused": {},
    "adamw_torch_8bit": _LOW_BIT,
    "adamw_torch_4bit": _LOW_BIT,
    "adamw_anyprecision": {
        "use_kahan_summation": (_bool, False),
        "momentum_dtype": (_dtype, torch.float32),
        "variance_dtype": (_dtype, torch.float32),
        "compensation_buffer_dtype": (_dtype, torch.bfloat16),
    },
    "sgd": {"momentum": (_nonnegative_float, 0.0), "dampening": (_nonnegative_float, 0.0), "nesterov": (_bool, False)},
}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIM_ARGS)
TORCHAO_OPTIMIZERS = {"adamw_torch_8bit": "AdamW8bit", "adamw_torch_4bit": "AdamW4bit"}


def parse_optim_args(optim: str, text: str | None) -> dict[str, Any]:
    """``optim_args`` for ``optim`` as typed keyword arguments, HF's defaults filled in. Raises ValueError
    naming the field, the key and the valid keys."""
    schema = OPTIM_ARGS[optim]
    given: dict[str, str] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"TrainingArguments(optim_args={text!r}): {item!r} is not key=value")
        if key not in schema:
            valid = ", ".join(schema) if schema else "none (leave optim_args unset)"
            raise ValueError(
                f"TrainingArguments(optim_args={text!r}): optim={optim!r} takes no {key!r}; valid keys: {valid}"
            )
        given[key] = value
    out = {}
    for key, (parse, default) in schema.items():
        if key not in given:
            out[key] = default
            continue
        try:
            out[key] = parse(given[key])
        except ValueError as err:
            raise ValueError(f"TrainingArguments(optim_args={text!r}): {key}={given[key]!r} {err}") from None
    return out


def make_optimizer(groups: list[dict[str, Any]], cfg: Any) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optim`` names over ``groups`` (with their weight decay), from an
    :class:`~mixprec.trainer.configs.OptimConfig` (not imported: the configs check names against this module).
    A torchao optimizer without torchao raises a one-line
    error with the pip command."""
    options = parse_optim_args(cfg.optim, cfg.optim_args)
    adam = {"lr": cfg.learning_rate, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}
    if cfg.optim == "adamw_torch":
        fused = options["fused"]
        return torch.optim.AdamW(groups, **adam, fused=fused_kernel_takes(groups) if fused is None else fused)
    if cfg.optim == "adamw_torch_fused":
        return torch.optim.AdamW(groups, **adam, fused=True)
    if cfg.optim in TORCHAO_OPTIMIZERS:
        optim_mod = import_torchao(f"optim={cfg.optim!r}", "torchao.optim")
        return getattr(optim_mod, TORCHAO_OPTIMIZERS[cfg.optim])(groups, **adam, **options)
    if cfg.optim == "adamw_anyprecision":
        return AnyPrecisionAdamW(groups, **adam, **options)
    return torch.optim.SGD(groups, lr=cfg.learning_rate, **options)


def fused_kernel_takes(groups: list[dict[str, Any]]) -> bool:
    """Whether torch's fused Adam(W) kernel takes every parameter of ``groups``: a floating-point dense tensor on
    a device torch has the kernel for (what ``AdamW(fused=True)`` checks at construction)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: its default implementation
        return False
    return all(
        p.device.type in devices and torch.is_floating_point(p) and not p.is_sparse
        for group in groups
        for p in group["params"]
    )


# -- what the Trainer builds ------------------------------------------------------------------------------


def build_optimizer(
    model: torch.nn.Module, cfg: Any, cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None
) -> torch.optim.Optimizer:
    """``cfg.optim`` (``args.optimization``) over the model's trainable parameters, in a decayed and a
    not-decayed group; or, with ``cls_and_kwargs`` (HF's ``optimizer_cls_and_kwargs``), ``cls(groups, **kwargs)``
    over the same groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameters with requires_grad=True: there is nothing to train")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    if cls_and_kwargs is not None:
        cls, kwargs = cls_and_kwargs
        return cls(groups, **(kwargs or {}))
    return make_optimizer(groups, cfg)


def _linear(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def _nanogpt_cosine(step: int, warmup: int, total: int) -> float:
    # nanoGPT's train.py get_lr (min_lr 0): the warm-up starts at 1/(warmup + 1) of the peak, so the first step
    # trains; HF's starts at 0, which spends step 0 on Adam's moments alone. On mixprec train's job that one
    # step's difference lowered the final validation loss by 0.08 nats/byte at 300 steps (3 seeds) and 0.14 at
    # 150 (4 seeds): small models escape their early plateau sooner (benchmarks/README.md, "vs_nanogpt")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return _cosine(step, warmup, total)


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int, total: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


_SCHEDULES = {
    "linear": _linear,
    "cosine": _cosine,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
    "nanogpt_cosine": _nanogpt_cosine,
}
SCHEDULER_NAMES: tuple[str, ...] = tuple(_SCHEDULES)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Any, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """HF's schedules (same formulas as ``transformers.get_scheduler``) over ``total_steps`` optimizer steps;
    ``cfg`` is ``args.schedule``."""
    warmup = 0 if cfg.lr_scheduler_type == "constant" else cfg.num_warmup_steps(total_steps)
    fn = functools.partial(_SCHEDULES[cfg.lr_scheduler_type], warmup=warmup, total=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
