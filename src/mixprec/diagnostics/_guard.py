"""Leave the model exactly as the diagnosis found it.

The diagnosis runs real forward/backward passes, which can change a model in ways a user would not expect
from "look at my model": dropout draws from the global RNG (changing the next training run), BatchNorm updates
its running statistics, ``.train()`` flips every submodule's mode. This guard snapshots all of that and
restores it, exception or not. Gradients are never written in the first place (the passes use
``torch.autograd.grad``), but ``.grad`` is snapshotted too so that a model hook writing it cannot leak out.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ModelGuard(contextlib.AbstractContextManager):
    """Snapshot on enter, restore on exit: module train/eval flags, ``requires_grad``, ``.grad`` (the same
    tensor objects, ``None`` included), buffer values and objects, and the CPU and CUDA RNG states.

    Cost: one copy of every buffer (running statistics are small next to parameters).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ModelGuard:
        m = self.model
        self._training = [(mod, mod.training) for mod in m.modules()]
        self._params = [(p, p.requires_grad, p.grad) for p in m.parameters()]
        self._buffers = [
            (mod, name, buf, buf.detach().clone())
            for mod in m.modules()
            for name, buf in mod._buffers.items()
            if buf is not None
        ]
        cuda_devices = [self.device.index or 0] if self.device.type == "cuda" else []
        # fork_rng restores the CPU (and listed CUDA) generators on exit: dropout during diagnosis must not
        # shift the random stream the training run that follows will see
        self._stack.enter_context(torch.random.fork_rng(devices=cuda_devices))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with torch.no_grad():
                for mod, name, buf, saved in self._buffers:
                    buf.copy_(saved)
                    mod._buffers[name] = buf
            for p, requires_grad, grad in self._params:
                p.requires_grad_(requires_grad)
                p.grad = grad
            for mod, training in self._training:
                mod.training = training
        finally:
            self._stack.close()
