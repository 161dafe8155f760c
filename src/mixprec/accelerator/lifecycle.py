"""The two ends of a prepared object's life in an Accelerator: what ``prepare`` accepts (and what it refuses
about a model, before touching it, with the fix in the message), and ``free_memory``."""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from mixprec.accelerator.prepared import PreparedScheduler
from mixprec.loaders.data import PreparedDataLoader

if TYPE_CHECKING:
    from mixprec.accelerator.gradients import GradientState
    from mixprec.checkpoint.folder_checks import Registry
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


def check_preparable(model: torch.nn.Module) -> None:
    # fp16/bf16 parameters are welcome: frozen ones stay as they are, trainable ones get fp32 masters when
    # the optimizer is prepared (mixprec.precision.master_weights)
    _check_quantized_placement(model)


def _check_quantized_placement(model: torch.nn.Module) -> None:
    """A model transformers loaded in 8 or 4 bits (bitsandbytes) with parts placed on the CPU or disk
    (``hf_device_map``) cannot be trained: its offloaded weights have no gradients to step (accelerate
    refuses it with the same ValueError)."""
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not isinstance(device_map, dict):
        return
    placed = {str(device) for device in device_map.values()}
    if placed & {"cpu", "disk"}:
        raise ValueError(
            "prepare(): this model was loaded in 8-bit or 4-bit precision with CPU or disk offload "
            f"(hf_device_map places parts on {sorted(placed & {'cpu', 'disk'})}), which cannot be trained; "
            "load it entirely on the training device, e.g. device_map={'': torch.cuda.current_device()}"
        )
