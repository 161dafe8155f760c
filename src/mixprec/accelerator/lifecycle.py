"""The two ends of a prepared object's life in an Accelerator: what ``prepare`` accepts, and ``free_memory``."""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from mixprec.accelerator.data import PreparedDataLoader
from mixprec.accelerator.prepared import PreparedScheduler

if TYPE_CHECKING:
    from mixprec.accelerator.gradients import GradientState
    from mixprec.accelerator.state import Registry
    from mixprec.precision.base import Precision

_ACCEPTED = (
    "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader and LR schedulers "
    "(torch.optim.lr_scheduler.LRScheduler)"
)


def object_kind(obj: Any, index: int) -> str:
    """ "model", "optimizer", "scheduler", "dataloader", or "none" for anything else, which ``prepare``
    returns unchanged as accelerate does (None silently; other objects with a warning naming the argument).
    A Dataset is a TypeError: it would go through unsharded and undevice'd, which no script means."""
    if obj is None:
        return "none"
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (DataLoader, PreparedDataLoader)):
        return "dataloader"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, PreparedScheduler)) or (
        hasattr(obj, "optimizer") and callable(getattr(obj, "step", None)) and hasattr(obj, "state_dict")
    ):
        return "scheduler"
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, Dataset):
        raise TypeError(
            f"prepare() got a Dataset ({kind}, argument {index}); wrap it in a torch.utils.data.DataLoader "
            "and prepare that, so that it is sharded across processes and its batches moved to the device"
        )
    warnings.warn(
        f"prepare() returns argument {index} ({kind}) unchanged: it prepares {_ACCEPTED}",
        UserWarning,
        stacklevel=3,
    )
    return "none"


def release_prepared(registry: Registry, gradients: GradientState, precision: Precision, device: torch.device) -> None:
    """Drop every reference the Accelerator holds to prepared models, optimizers, schedulers and DataLoaders
    (the precision's parameter list too), collect garbage, and empty the device's cache allocator."""
    for optimizer in registry.optimizers:
        if optimizer.stepper is not None:  # step_in_backward: the parameters stop stepping this optimizer
            optimizer.stepper.remove()
    registry.models.clear()
    registry.optimizers.clear()
    registry.schedulers.clear()
    registry.dataloaders.clear()
    gradients.forget_optimizers()
    precision.forget_parameters()
    gc.collect()
    empty = getattr(getattr(torch, device.type, None), "empty_cache", None)
    if device.type != "cpu" and callable(empty):
        empty()
