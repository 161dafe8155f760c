"""Host copies of a state for an asynchronous save, in buffers reused from one save to the next.

``save_state(async_save=True)`` returns while a thread writes the state; the live tensors change at the next
optimizer step, so the writer gets a copy. :class:`HostStaging` keeps that copy to one pass over the leaves and
one ``torch._foreach_copy_`` (issue 24): the first save plans it (which leaves are tensors, which tensors are
one tensor under two names, a host buffer for each), later saves whose tensors have the same addresses, shapes,
strides and dtypes copy into the same buffers, so a save after the first allocates (and page-faults) nothing.
Anything else rebuilds the plan, never copies into a buffer that does not fit (``copy_`` would broadcast a
smaller source into it). Buffers for CUDA tensors are pinned host memory.

The copy need not stall the caller (issue 24's second round): the next forward and backward only read the
weights and the optimizer's moments, so a save may :meth:`HostStaging.capture` the tensors (the walk, no copy)
and leave the plan and the copy to its writer thread, provided everything that changes those tensors waits
for the copy first (:meth:`mixprec.checkpoint.background.BackgroundWriter.fence`). What a forward itself
rewrites (a BatchNorm's running statistics: the caller names their addresses in ``now``) is cloned at the
capture. Tensors off the CPU are copied at the capture, all of them, as before: a copy from a CUDA device on
another thread would need a stream of its own, ordered after the step's kernels (not built yet).

A tensor subclass that wraps plain tensors is copied as the tensors it holds (:func:`_unwrapped`). Non-tensor
leaves (a learning rate, a step kept as a number) are not copied: they are taken as they are at the call, in
new containers, as ``copy.deepcopy`` would keep immutable values.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Set
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mixprec.tree import TreeSpec, tree_flatten, tree_unflatten


class HostStaging:
    """The plan and the host buffers of the last copy. Not thread-safe: the caller stages only when the
    previous copy is no longer read (its writer has finished)."""

    def __init__(self) -> None:
        # the plan is a function of the tensors' keys alone (not of the containers around them): the i-th
        # tensor leaf goes into buffer _slot[i], which fits it as long as its key is the one planned for
        self._keys: list[tuple[Any, ...]] = []  # per tensor leaf, in order: address, shape, strides, dtype
        self._slot: list[int] = []  # per tensor leaf: its buffer (tied tensors share one)
        self._buffers: list[torch.Tensor] = []

    def capture(self, states: Any, *, defer: bool = True, now: Set[int] = frozenset()) -> Staged:
        """The tensors of ``states``, to be copied by :meth:`Staged.copy` (on the writer thread, before anything
        changes them in place and before the next capture). Tensors whose ``data_ptr()`` is in ``now`` are
        cloned here; with ``defer=False``, or any tensor off the CPU, everything is copied here (blocking until
        the copy is complete: a device-to-host copy synchronises with the device). Cost: one tree walk (plus
        the copy where it is not deferred)."""
        leaves, spec = tree_flatten(states)
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        staged = Staged(self, leaves, spec, tensor_at)
        if not defer or not all(leaves[i].is_cpu for i in tensor_at):
            staged.copy()
        elif now:
            clones: dict[tuple[Any, ...], torch.Tensor] = {}  # a buffer under two names stays one tensor
            for position, i in enumerate(tensor_at):
                if leaves[i].numel() and not is_traceable_wrapper_subclass(leaves[i]) and leaves[i].data_ptr() in now:
                    key = _key(leaves[i], position)
                    if key not in clones:
                        clones[key] = leaves[i].clone()  # preserve_format: a sync save's strides
                    leaves[i] = clones[key]
        return staged

    def _copy(self, leaves: list[Any], tensor_at: list[int]) -> None:
        """Replace each tensor leaf by its host buffer, filled with its values."""
        tensors, rebuild = _unwrapped([leaves[i] for i in tensor_at])
        keys = [_key(t, i) for i, t in enumerate(tensors)]
        if keys != self._keys:
            self._plan(tensors, keys)
        sources: list[torch.Tensor | None] = [None] * len(self._buffers)
        for slot, tensor in zip(self._slot, tensors):
            sources[slot] = tensor
        if self._buffers:
            _copy_into(self._buffers, sources)  # type: ignore[arg-type]
        for i, copy in zip(tensor_at, rebuild([self._buffers[slot] for slot in self._slot])):
            leaves[i] = copy

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


class Staged:
    """One save's captured state: :meth:`copy` makes the host copy (once), :meth:`states` returns the state
    with each tensor replaced by its host copy (tied tensors stay one tensor; containers new, other leaves
    shared). Both belong to the writer thread, before the next capture."""

    def __init__(self, staging: HostStaging, leaves: list[Any], spec: TreeSpec, tensor_at: list[int]) -> None:
        self._staging, self._leaves, self._spec, self._tensor_at = staging, leaves, spec, tensor_at
        self._copied = False

    def copy(self) -> None:
        """Copy the tensors into the staging's buffers, if not done yet. Costs the plan's keys (one tuple per
        tensor) and one foreach copy."""
        if not self._copied:
            self._staging._copy(self._leaves, self._tensor_at)
            self._copied = True

    def states(self) -> Any:
        """The state with host copies (copied first if need be); rebuilding the containers is a tree walk."""
        self.copy()
        return tree_unflatten(self._leaves, self._spec)


def _unwrapped(
    tensors: list[torch.Tensor],
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], list[torch.Tensor]]]:
    """``tensors`` as plain tensors, and how to build them again from copies of those. A tensor subclass that
    wraps plain tensors (torchao's 8-bit and 4-bit optimizer states: codes, scales and a shared quantisation
    map; torch's DTensor) stands for the tensors it holds, since such a class need not implement ``empty_like``
    or ``copy_``; its copy is the class built again (``__tensor_unflatten__``) around copies of them."""
    flat: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> Callable[[Iterator[torch.Tensor]], torch.Tensor]:
        if not is_traceable_wrapper_subclass(tensor):
            flat.append(tensor)
            return next
        names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [take(getattr(tensor, name)) for name in names]
        cls, size, stride = type(tensor), tensor.size(), tensor.stride()
        return lambda copies: cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            {name: build(copies) for name, build in zip(names, inner)}, context, size, stride
        )

    builds = [take(t) for t in tensors]

    def rebuild(copies: list[torch.Tensor]) -> list[torch.Tensor]:
        each = iter(copies)
        return [build(each) for build in builds]

    return flat, rebuild


def _copy_into(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``buffers[i][...] = sources[i]``. Host tensors laid out as their buffer (dense, same strides: the usual
    case) are copied byte for byte by one thread, everything else by ``torch._foreach_copy_``. The copy runs on
    the writer thread, and a parallel torch op there gives that thread an OpenMP team of its own: with more
    OpenMP threads than cores, libgomp's workers stop spinning between regions and every op of the training
    thread pays a wake-up for as long as the writer lives (the main job's forward took 1.5x as long after its
    first save: benchmarks/README.md). ``torch.set_num_threads(1)`` on the writer is no way out: torch keeps
    one count for the process, which threads that have not run an op yet (the caller's too) would take up."""
    rest_buffers, rest_sources = [], []
    for buffer, source in zip(buffers, sources):
        if _bytes_alike(buffer, source):
            ctypes.memmove(buffer.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
        else:
            rest_buffers.append(buffer)
            rest_sources.append(source)
    if rest_buffers:
        with torch.no_grad():
            torch._foreach_copy_(rest_buffers, rest_sources)


def _bytes_alike(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``source``'s values are its bytes, laid out as ``buffer``'s: plain host tensors (no subclass such
    as DTensor or a low-bit optimizer state, no conjugate or negative view, not quantized or sparse) with the
    strides ``empty_like`` gave the buffer, which it keeps only for a dense source: one span of bytes."""
    plain = (torch.Tensor, torch.nn.Parameter)
    return (
        type(source) in plain
        and type(buffer) in plain
        and source.is_cpu
        and source.layout == torch.strided
        and not (source.is_quantized or source.is_conj() or source.is_neg())
        and source.dtype == buffer.dtype
        and source.shape == buffer.shape
        and source.stride() == buffer.stride()
    )


def _key(tensor: torch.Tensor, position: int) -> tuple[Any, ...]:
    """Equal for two names of one tensor (a tied weight), and across saves for the same live tensor."""
    if tensor.numel() == 0:  # no storage to tell empty tensors apart: each is its own
        return (position, tensor.shape, tensor.dtype)
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
