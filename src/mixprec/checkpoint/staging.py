"""Host copies of a state for an asynchronous save, in buffers reused from one save to the next.

``save_state(async_save=True)`` returns while a thread writes the state; the live tensors change at the next
step, so the writer gets a copy, and making it is the save's stall. :class:`HostStaging` keeps that copy to
one pass over the leaves and one ``torch._foreach_copy_`` (issue 24): the first save plans it (which leaves
are tensors, which tensors are one tensor under two names, a host buffer for each), later saves whose tensors
have the same addresses, shapes, strides and dtypes copy into the same buffers, so a save after the first
allocates (and page-faults) nothing. Anything else rebuilds the plan, never copies into a buffer that does not
fit (``copy_`` would broadcast a smaller source into it). Buffers for CUDA tensors are pinned host memory.

Non-tensor leaves (a learning rate, a step kept as a number) are not copied: they are taken as they are at the
call, in new containers, as ``copy.deepcopy`` would keep immutable values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mixprec.tree import tree_flatten, tree_unflatten


class HostStaging:
    """The plan and the host buffers of the last :meth:`stage`. Not thread-safe: the caller stages only when
    the previous copy is no longer read (its writer has finished)."""

    def __init__(self) -> None:
        # the plan is a function of the tensors' keys alone (not of the containers around them): the i-th
        # tensor leaf goes into buffer _slot[i], which fits it as long as its key is the one planned for
        self._keys: list[tuple[Any, ...]] = []  # per tensor leaf, in order: address, shape, strides, dtype
        self._slot: list[int] = []  # per tensor leaf: its buffer (tied tensors share one)
        self._buffers: list[torch.Tensor] = []

    def stage(self, states: Any) -> Callable[[], Any]:
        """Copy every tensor of ``states`` now; returns what builds ``states`` with each tensor replaced by its
        host copy (tied tensors stay one tensor; containers new, other leaves shared), to call later (on the
        writer thread: rebuilding the containers is no part of the stall) and before the next :meth:`stage`.
        Blocks until the copy is complete (a device-to-host copy synchronises with the device). Cost after the
        first call: one tree walk, one tuple per tensor, one foreach copy."""
        leaves, spec = tree_flatten(states)
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_at]
        keys = [_key(t, i) for i, t in enumerate(tensors)]
        if keys != self._keys:
            self._plan(tensors, keys)
        sources: list[torch.Tensor | None] = [None] * len(self._buffers)
        for slot, tensor in zip(self._slot, tensors):
            sources[slot] = tensor
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, sources)  # type: ignore[arg-type]
        for i, slot in zip(tensor_at, self._slot):
            leaves[i] = self._buffers[slot]
        return functools.partial(tree_unflatten, leaves, spec)

    def _plan(self, tensors: list[torch.Tensor], keys: list[tuple[Any, ...]]) -> None:
        # buffers of the old plan are kept where one fits (same shape and dtype): a state that changed shape
        # in one place (a new parameter group) does not reallocate the rest
        spare: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for buffer in self._buffers:
            spare.setdefault((buffer.shape, buffer.stride(), buffer.dtype, buffer.is_pinned()), []).append(buffer)
        first: dict[tuple[Any, ...], int] = {}
        slots: list[int] = []
        buffers: list[torch.Tensor] = []
        for key, tensor in zip(keys, tensors):
            if key not in first:
                first[key] = len(buffers)
                pinned = tensor.device.type == "cuda"  # pinned: a faster copy from the device
                layout = torch.empty_like(tensor, device="meta")  # the source's strides (a sync save's bytes)
                fits = spare.get((layout.shape, layout.stride(), layout.dtype, pinned))
                buffers.append(fits.pop() if fits else torch.empty_like(tensor, device="cpu", pin_memory=pinned))
            slots.append(first[key])
        self._keys, self._slot, self._buffers = keys, slots, buffers


def _key(tensor: torch.Tensor, position: int) -> tuple[Any, ...]:
    """Equal for two names of one tensor (a tied weight), and across saves for the same live tensor."""
    if tensor.numel() == 0:  # no storage to tell empty tensors apart: each is its own
        return (position, tensor.shape, tensor.dtype)
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
