"""What ``prepare`` refuses about a model, before touching it, with the fix in the message."""

from __future__ import annotations

import torch


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


def check_no_low_precision_trainable(model: torch.nn.Module, where: str, fix: str) -> None:
    """Where a trainable fp16/bf16 parameter cannot get its fp32 master (see
    :mod:`mixprec.precision.master_weights`): refuse it by name, with ``fix``."""
    from mixprec.precision.master_weights import needs_master

    for name, p in model.named_parameters():
        if needs_master(p):
            raise ValueError(
                f"{where}: parameter {name!r} is {str(p.dtype).removeprefix('torch.')} and trainable, and "
                f"cannot get an fp32 master copy here; {fix}"
            )
