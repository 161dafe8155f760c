"""Bytes per parameter of training state: parameters + gradients + optimizer state, counted from the tensors.

What a precision costs in memory beyond activations: fp32 with AdamW holds 4 + 4 + 8 = 16 bytes per
parameter (master weight, gradient, two moments), whatever the autocast dtype; pure bf16 holds 2 + 2 + 4 = 8;
8-bit Adam states bring the moments to ~2. Counted after a step (so lazily created optimizer state exists),
with gradients as they are (or, when already zeroed to None, as one per trainable parameter in its dtype).
"""

from __future__ import annotations

from typing import Any

import torch


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    from torch.utils._pytree import tree_leaves

    total = 0
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.numel() > 1 and id(t) not in seen:  # scalars: step counters
            seen.add(id(t))
            total += _nbytes(t)
    return total


def _nbytes(t: torch.Tensor) -> int:
    # torchao's low-bit states are tensor subclasses whose real storage is in their inner tensors
    inner = getattr(t, "__tensor_flatten__", None)
    if callable(inner) and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = inner()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def training_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step_in_backward: bool = False
) -> dict[str, float]:
    """{"params", "grads", "optimizer", "total"} in bytes, and "per_param" = total / parameter count.
    ``step_in_backward``: each gradient is freed as soon as it is applied, so at most one is alive at a time:
    the largest one counts."""
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    param_bytes = sum(_nbytes(p) for p in params)
    grads = [_nbytes(p.grad) if p.grad is not None else p.numel() * p.element_size() for p in params if p.requires_grad]
    grad_bytes = max(grads, default=0) if step_in_backward else sum(grads)
    seen: set[int] = {id(p) for p in params}
    opt_bytes = _tensor_bytes(list(optimizer.state.values()), seen) if optimizer is not None else 0
    total = param_bytes + grad_bytes + opt_bytes
    return {
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer": opt_bytes,
        "total": total,
        "per_param": total / max(n, 1),
    }
