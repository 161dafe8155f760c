"""``mixprec train --lora-r N``: LoRA adapters (peft) on a frozen Hugging Face model.

The base is frozen and held in the precision's compute dtype (fp16 under ``--precision fp16``, bf16 under bf16,
bf16-pure and fp8; fp32 under fp32 and auto, whose dtype is not known before its race): that is the memory
win, since a frozen parameter needs no fp32 master, no gradient and no optimizer state. peft keeps the
adapters in fp32 (``autocast_adapter_dtype=True``), and the forward runs under the precision's autocast as
for any model (see :mod:`mixprec.precision.master_weights` for trainable fp16/bf16 parameters).

Target modules: ``--lora-targets`` (comma-separated names, or ``all-linear``); by default peft's choice for
the architecture (GPT-2's ``c_attn``, Llama's ``q_proj,v_proj``...), else every linear layer but the head.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.cli._common import positive_float, positive_int
from mixprec.cli.main import CliError
from mixprec.models import GPT_PRESETS
from mixprec.precision.base import Precision

ALL_LINEAR = "all-linear"


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """Add --lora-r, --lora-alpha and --lora-targets to ``parser``."""
    g = parser.add_argument_group("LoRA adapters (needs peft: pip install peft)")
    g.add_argument(
        "--lora-r",
        metavar="N",
        type=positive_int,
        default=None,
        help="train rank-N LoRA adapters on a frozen --model (a local Hugging Face folder) instead of every "
        "weight; the frozen base is held in the precision's compute dtype (default: off)",
    )
    g.add_argument(
        "--lora-alpha",
        metavar="A",
        type=positive_float,
        default=None,
        help="LoRA scaling numerator: the update is scaled by A/N (default: 2N)",
    )
    g.add_argument(
        "--lora-targets",
        metavar="NAMES",
        default=None,
        help=f"comma-separated module names to adapt, or {ALL_LINEAR!r} (default: peft's choice for the "
        f"architecture, else {ALL_LINEAR})",
    )


@dataclass(frozen=True)
class LoraPlan:
    """What ``--lora-*`` asked for, checked."""

    r: int
    alpha: float
    targets: list[str] | str | None
    """Module names, "all-linear", or None for peft's default for the architecture."""
    base_dtype: torch.dtype
    """The frozen base's dtype: the precision's compute dtype (fp32 for "auto", still undecided)."""


def lora_plan(args: argparse.Namespace, precision: Precision) -> LoraPlan | None:
    """The checked LoRA flags, or None without --lora-r (checked before anything is loaded). Raises CliError
    naming the flag and the fix."""
    r = getattr(args, "lora_r", None)
    if r is None:
        for flag in ("lora_alpha", "lora_targets"):
            if getattr(args, flag, None) is not None:
                raise CliError(f"--{flag.replace('_', '-')} needs --lora-r N (the adapters' rank)")
        return None
    if getattr(args, "model", None) in GPT_PRESETS:
        raise CliError(
            f"--lora-r {r}: LoRA adapters go on a Hugging Face model; pass --model <local HF folder> "
            "(the built-in GPTs train every weight)"
        )
    try:
        import peft  # noqa: F401
    except ModuleNotFoundError:
        raise CliError(f"--lora-r {r}: LoRA needs peft; pip install peft (or pip install 'mixprec[lora]')") from None
    targets = getattr(args, "lora_targets", None)
    if targets is not None and targets.strip() != ALL_LINEAR:
        targets = [name.strip() for name in targets.split(",") if name.strip()]
        if not targets:
            raise CliError(f"--lora-targets {args.lora_targets!r}: name at least one module, or {ALL_LINEAR!r}")
    elif targets is not None:
        targets = ALL_LINEAR
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * r
    return LoraPlan(r, alpha, targets, torch.float32 if precision.pending else precision.compute_dtype)


def apply_lora(model: torch.nn.Module, plan: LoraPlan) -> tuple[Any, str]:
    """``model`` (loaded in ``plan.base_dtype``) frozen under peft LoRA adapters; and one line saying so."""
    import peft
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    targets = plan.targets
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        targets = DEFAULT_TARGETS.get(model_type, ALL_LINEAR)
    dtype = plan.base_dtype
    model = model.to(dtype)  # a no-op when loaded in it (load_model_and_data's dtype)
    config = peft.LoraConfig(
        r=plan.r, lora_alpha=plan.alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    try:
        wrapped = peft.get_peft_model(model, config)  # adapters in fp32 (autocast_adapter_dtype=True)
    except ValueError as exc:
        detail = " ".join(str(exc).split())[:200]
        raise CliError(f"--lora-targets: peft cannot adapt this model ({detail}); name modules that exist") from None
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    shown = targets if isinstance(targets, str) else ", ".join(targets)
    line = (
        f"LoRA r={plan.r}, alpha {plan.alpha:g} on {shown}: {trained / 1e6:.3f}M of {total / 1e6:.2f}M parameters "
        f"trained; frozen base in {str(dtype).removeprefix('torch.')}"
    )
    return wrapped, line
