"""What ``prepare`` refuses about a model, before touching it, with the fix in the message."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mixprec.precision.base import Precision


def check_preparable(model: torch.nn.Module, precision: Precision) -> None:
    _check_quantized_placement(model)
    _check_master_weights(model, precision)


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


def _check_master_weights(model: torch.nn.Module, precision: Precision) -> None:
    if precision.compute_dtype == torch.float32 or precision.param_dtype != torch.float32:
        return  # full precision: parameters in whatever dtype the user chose; pure modes convert them
    for name, p in model.named_parameters():
        if p.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"prepare(): parameter {name!r} is {str(p.dtype).removeprefix('torch.')}, but "
                f"mixed_precision={precision.name!r} keeps fp32 master weights and computes in "
                f"{str(precision.compute_dtype).removeprefix('torch.')} under autocast: don't call "
                "model.half() / model.to(torch.bfloat16) before prepare"
            )
