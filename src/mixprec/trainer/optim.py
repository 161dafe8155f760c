"""The optimizer and learning-rate schedule a Trainer builds when the user passes none.

The optimizer ``args.optim`` names (see :mod:`mixprec.trainer.optimizers`; AdamW by default); weight decay
only on tensors with two or more dimensions (matrices and embeddings), never on biases and norm gains, as
nanoGPT and HF both do. The schedules are ``LambdaLR`` over picklable-free ``functools.partial`` objects, so
the scheduler's state dict is plain numbers (saved as JSON).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from mixprec.trainer.configs import OptimConfig, ScheduleConfig
from mixprec.trainer.optimizers import make_optimizer


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None
) -> torch.optim.Optimizer:
    """``cfg.optim`` over the model's trainable parameters, in a decayed and a not-decayed group; or, with
    ``cls_and_kwargs`` (HF's ``optimizer_cls_and_kwargs``), ``cls(groups, **kwargs)`` over the same groups."""
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


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int, total: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


_SCHEDULES = {
    "linear": _linear,
    "cosine": _cosine,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
}


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """HF's schedules (same formulas as ``transformers.get_scheduler``) over ``total_steps`` optimizer steps."""
    warmup = 0 if cfg.lr_scheduler_type == "constant" else cfg.num_warmup_steps(total_steps)
    fn = functools.partial(_SCHEDULES[cfg.lr_scheduler_type], warmup=warmup, total=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
