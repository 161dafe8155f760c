"""Forward and gradient hooks that are always removed: shared by the diagnosis and the precision watch.

The diagnosis hooks every named module's outputs (forward hooks) and, through plain tensor hooks on those
outputs, their gradients. Tensor hooks rather than ``register_full_backward_hook``: the full backward hook
wraps outputs in a custom autograd function, which breaks modules whose outputs are later modified in place
(``nn.ReLU(inplace=True)``) or are not all tensors, and the diagnosis must run on any model unchanged.

The precision watch (:mod:`mixprec.watch`) installs the same hooks for one sampled training step at a time
and removes them when the step ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.tree import tree_leaves

ROOT_NAME = "<model>"
"""How the report names the model itself (its qualified name is the empty string)."""


def display_name(qualified: str) -> str:
    return qualified or ROOT_NAME


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in a module's output: nested tuples, lists, mappings (HF ``ModelOutput``
    included) and dataclasses (mixprec.tree). Integer tensors (token ids, argmax) carry no magnitude worth
    measuring."""
    try:
        leaves = tree_leaves(obj)
    except RecursionError:  # a self-referencing output: measure nothing rather than fail the model's forward
        return
    yield from (leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_floating_point())


OutputFn = Callable[[str, torch.Tensor], bool | None]
"""Called as fn(qualified_module_name, tensor) for each floating tensor a module outputs. Returning False
says "not this tensor's gradient": no gradient hook is put on it (the watch passes over a tensor a child module
already returned, and over the loss, whose gradient is the backward seed)."""
GradFn = Callable[[str, torch.Tensor, int], None]
"""Called as fn(qualified_module_name, grad, id_of_the_output_tensor) when backward reaches an output. The id
(not the tensor: a closure holding it would make a reference cycle through its grad_fn) lets a caller skip
the loss itself, whose gradient is always the backward seed (1, or the loss scale)."""


class HookRegistry(contextlib.AbstractContextManager):
    """Owns every hook handle the diagnosis creates, module and tensor hooks alike; :meth:`remove_all` (or
    leaving the ``with`` block, exception or not) removes them all."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __exit__(self, *exc: object) -> None:
        self.remove_all()

    def hook_module_outputs(
        self,
        model: nn.Module,
        on_output: OutputFn | None,
        on_output_grad: GradFn | None,
    ) -> None:
        """Call ``on_output`` for every floating tensor each named module returns (in execution order), and
        ``on_output_grad`` with the gradient of each such tensor when backward reaches it. A tensor returned by
        several modules (a ``Sequential`` returns its last child's output) is reported once per module.
        Hooks run under ``torch.no_grad`` and never change the tensors they see."""
        for name, module in model.named_modules():
            self.add(module.register_forward_hook(self._forward_hook(name, on_output, on_output_grad)))

    def _forward_hook(self, name: str, on_output: OutputFn | None, on_output_grad: GradFn | None) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for t in iter_tensors(output):
                follow = None
                if on_output is not None:
                    with torch.no_grad():
                        follow = on_output(name, t)
                if on_output_grad is not None and t.requires_grad and follow is not False:
                    self.add(t.register_hook(self._grad_hook(name, on_output_grad, id(t))))

        return hook

    def hook_forward_pre(self, module: nn.Module, fn: Callable[[nn.Module, tuple, dict], None]) -> None:
        """Call ``fn(module, args, kwargs)`` before every call of ``module`` itself (not of its children), with
        the arguments it is about to receive. ``fn`` returns nothing: the arguments are passed on unchanged.
        The precision watch uses it to see each training step begin and to keep the step's batch."""
        self.add(module.register_forward_pre_hook(fn, with_kwargs=True))

    @staticmethod
    def _grad_hook(name: str, fn: GradFn, tensor_id: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
            with torch.no_grad():
                fn(name, grad, tensor_id)

        return hook


def param_owners(model: nn.Module) -> list[tuple[str, str, nn.Parameter]]:
    """(owning module's qualified name, parameter name, parameter) for each distinct trainable parameter.

    A tied parameter (shared embedding / LM head) is listed once, under the first module that holds it.
    """
    seen: set[int] = set()
    out = []
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            out.append((mod_name, p_name, p))
    return out


def hooks_left(model: nn.Module) -> list[str]:
    """Names of modules that still hold forward or backward hooks (for tests and sanity checks)."""
    attrs = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return [display_name(n) for n, m in model.named_modules() if any(getattr(m, a, None) for a in attrs)]
