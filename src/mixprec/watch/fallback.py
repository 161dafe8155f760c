"""Per-module fp32 fallback: one module computes in fp32 while the rest of the model stays in fp16.

A module marked for fp32 runs its forward with autocast disabled and its floating inputs cast up to fp32, so
every op inside it (matmuls included) computes and stores in fp32, with fp32's range; its outputs are fp32,
and the next module's autocast casts them down again where it computes in fp16. This is how a long fp16 run
survives one layer that outgrows fp16's 65504 without moving the whole model to fp32 or bf16.

The switch is an instance-level ``forward`` (as ``Accelerator.prepare`` patches the root's), so the module's
class, parameters, ``state_dict`` keys and hooks stay exactly as they were, and :func:`restore` undoes it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

_MARK = "_mixprec_fp32"
_INNER = "_mixprec_fp32_inner"
_LOW = (torch.float16, torch.bfloat16)


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


def _fp32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward in fp32: autocast off inside, fp16/bf16 inputs cast up. No host sync."""
    inner = self.__dict__.get(_INNER) or types.MethodType(type(self).forward, self)
    args, kwargs = tree_map_only(torch.Tensor, _up, (args, kwargs))
    device_type = _device_type(args, kwargs, self)
    with torch.autocast(device_type, enabled=False):
        return inner(*args, **kwargs)


def _device_type(args: Any, kwargs: Any, module: nn.Module) -> str:
    for t in (*args, *kwargs.values(), *module.parameters(recurse=False)):
        if isinstance(t, torch.Tensor):
            return t.device.type
    for t in module.parameters():
        return t.device.type
    return "cpu"


def run_in_fp32(module: nn.Module) -> None:
    """Make ``module`` compute in fp32 from now on (idempotent)."""
    if is_fp32(module):
        return
    if "forward" in module.__dict__:  # already patched by something else (another wrapper): keep it inside
        module.__dict__[_INNER] = module.__dict__["forward"]
    module.__dict__[_MARK] = True
    module.__dict__["forward"] = types.MethodType(_fp32_forward, module)


def restore(module: nn.Module) -> None:
    """Undo :func:`run_in_fp32`."""
    if not is_fp32(module):
        return
    del module.__dict__[_MARK]
    inner = module.__dict__.pop(_INNER, None)
    if inner is not None:
        module.__dict__["forward"] = inner
    else:
        del module.__dict__["forward"]


def is_fp32(module: nn.Module) -> bool:
    return module.__dict__.get(_MARK, False)


def fp32_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` running in fp32 through this fallback."""
    return [name for name, m in model.named_modules() if is_fp32(m)]
