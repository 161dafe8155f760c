"""The optimizers ``TrainingArguments(optim=...)`` names: Hugging Face's names and meanings, in one table.

==========================  =========================================================  ===========================
``optim``                   what it builds                                             bytes / param (states)
==========================  =========================================================  ===========================
``adamw_torch``             ``torch.optim.AdamW``                                      8 (fp32 moments)
``adamw_torch_fused``       the same, one fused kernel                                 8
``adamw_torch_8bit``        torchao ``AdamW8bit``: moments quantised in blocks         ~2 (+ fp32 for small tensors)
``adamw_torch_4bit``        torchao ``AdamW4bit``                                      ~1 (+ fp32 for small tensors)
``adamw_anyprecision``      :class:`~mixprec.trainer.anyprecision.AnyPrecisionAdamW`  4 with bf16 moments
``sgd``                     ``torch.optim.SGD``                                        0 (4 with momentum)
==========================  =========================================================  ===========================

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

from collections.abc import Callable
from typing import Any

import torch

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
    "adamw_torch": {},
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
    :class:`~mixprec.trainer.configs.OptimConfig`. A torchao optimizer without torchao raises a one-line
    error with the pip command."""
    options = parse_optim_args(cfg.optim, cfg.optim_args)
    adam = {"lr": cfg.learning_rate, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}
    if cfg.optim in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(groups, **adam, fused=cfg.optim == "adamw_torch_fused")
    if cfg.optim in TORCHAO_OPTIMIZERS:
        optim_mod = import_torchao(f"optim={cfg.optim!r}", "torchao.optim")
        return getattr(optim_mod, TORCHAO_OPTIMIZERS[cfg.optim])(groups, **adam, **options)
    if cfg.optim == "adamw_anyprecision":
        from mixprec.optim.anyprecision import AnyPrecisionAdamW

        return AnyPrecisionAdamW(groups, **adam, **options)
    return torch.optim.SGD(groups, lr=cfg.learning_rate, **options)
