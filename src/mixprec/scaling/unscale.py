"""Unscale gradients and check them for inf/NaN, for every floating dtype on every device.

torch's fused kernel (``torch._amp_foreach_non_finite_check_and_unscale_``) does both in one pass, but not for
every dtype everywhere: torch 2.11's CUDA build refuses bf16 (issue 28), which a bf16 parameter beside fp32
ones under fp16 scaling hits. For such a (device type, dtype) the gradients are staged through one flat fp32
buffer and the same kernel: bit-exact by construction, as the fused kernel itself computes in fp32 (checking
each value before the multiply) and rounds once to nearest on store, as the copy back does; nor does it rely
on a reduction propagating NaN (``_foreach_norm``'s max is not documented to).

Costs: no host sync on either path. The staged path holds an fp32 copy of at most ``STAGE_ELEMENTS`` gradient
values at a time (256 MiB) and costs three extra passes over them; it runs only for the dtypes the fused
kernel refuses, learned once per (device type, dtype) from the kernel's own NotImplementedError.
"""

from __future__ import annotations

import torch

STAGE_ELEMENTS = 1 << 26  # fp32 staging buffer bound: 256 MiB whatever the model
# (device type, dtype) pairs the fused kernel refused; filled on the first refusal, so each costs one raise
_REFUSED: set[tuple[str, torch.dtype]] = set()


def check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place; set ``found_inf`` (a 0-d fp32
    tensor on their device) to 1.0 when any value was inf/NaN before the multiply, else leave it. No host sync.

    torch's fused kernel where it takes the dtype, :func:`staged_check_and_unscale_` where it does not."""
    if not grads:
        return
    key = (grads[0].device.type, grads[0].dtype)
    if key not in _REFUSED:
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            return
        except NotImplementedError:
            # raised by the dtype dispatch, before the kernel touches a gradient: nothing is half-unscaled
            _REFUSED.add(key)
    staged_check_and_unscale_(grads, found_inf, inv_scale)


def staged_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, stage_elements: int = STAGE_ELEMENTS
) -> None:
    """The fused kernel's result for a dtype it refuses: the gradients through an fp32 buffer, in batches of
    at most ``stage_elements`` values (a larger single gradient is a batch of its own). No host sync."""
    batch: list[torch.Tensor] = []
    size = 0
    # FSDP2's gradients are DTensors: stage their local shards (in place; the inf check is all-reduced after)
    grads = [g.to_local() if callable(getattr(g, "to_local", None)) else g for g in grads]
    for grad in grads:
        if batch and size + grad.numel() > stage_elements:
            _stage(batch, found_inf, inv_scale)
            batch, size = [], 0
        batch.append(grad)
        size += grad.numel()
    if batch:
        _stage(batch, found_inf, inv_scale)


def _stage(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    # a foreach copy in (widening is exact), one fused kernel, a foreach copy back (rounds to nearest)
    # fp32 for the half types (their opmath); fp64 stays fp64, as the kernel computes doubles in double
    wide = torch.promote_types(grads[0].dtype, torch.float32)
    flat = torch.empty(sum(g.numel() for g in grads), dtype=wide, device=grads[0].device)
    views = [part.view(g.shape) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]
    torch._foreach_copy_(views, grads)
    torch._amp_foreach_non_finite_check_and_unscale_([flat], found_inf, inv_scale)
    torch._foreach_copy_(grads, views)
