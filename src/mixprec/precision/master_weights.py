"""fp32 master copies of trainable fp16/bf16 parameters, so adapters on a frozen half-precision base train.

The everyday fine-tune loads a model in fp16 or bf16 and trains a small part of it (LoRA adapters, a head, a
few norms). The frozen parameters need no fp32 copy: keeping them low is the memory win. A *trainable* one
stepped in its own dtype would lose every update smaller than half its ulp (``1 + 1e-4`` is ``1`` in both
fp16 and bf16), and fp16 gradients cannot be unscaled safely. So each mode that keeps fp32 master weights
(every mode but the pure ones, whose contract is bf16 weights) gives such a parameter an fp32 master:

- the optimizer holds the master in the model parameter's place (its Adam moments are fp32 too);
- after backward, the parameter's gradient (fp16 or bf16, scaled in fp16 mode) is copied to the master as
  fp32 once per step, before the scaler unscales and checks it (:meth:`MasterWeightsOptimizer.gather_grads`);
- after the step the model parameter is refreshed from its master (rounded to its dtype), skipped or not
  (a skipped step left the master as it was, so the refresh changes nothing).

The true (unscaled) gradient of such a parameter is its master's ``.grad`` during the step; the model
parameter's ``.grad`` stays as backward left it (scaled, under fp16: unscaled in fp16 a small one would
underflow, which is what the master is for). ``accelerator.clip_grad_norm_`` clips the masters.

The model keeps the dtypes its author gave it (``state_dict`` and ``save_pretrained`` write them), the frozen
parameters are never copied, and the forward runs under the mode's autocast as before. Cost: 4 bytes per
trainable low-precision element for the master, 4 more for its gradient during the step; two elementwise
copies per step; no host sync.

A model parameter changed outside the step (``load_state_dict``, ``load_state``, an EMA swap) is noticed by
its version counter, and its master is re-read from it before the next step, so a master never overwrites
newer weights. ``state_dict()`` carries the masters, so a resume continues with their full fp32 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec.optim.wrapped import WrappedOptimizer

_LOW_PRECISION = (torch.float16, torch.bfloat16)
STATE_KEY = "mixprec_master_weights"  # the masters in param_groups order, beside the optimizer's own state


def needs_master(param: torch.Tensor) -> bool:
    """Whether ``param`` is a trainable fp16/bf16 parameter (a frozen one stays as it is)."""
    return param.requires_grad and param.dtype in _LOW_PRECISION


def with_master_weights(
    optimizer: torch.optim.Optimizer, name_of: Callable[[torch.Tensor], str]
) -> torch.optim.Optimizer:
    """``optimizer`` itself when none of its parameters needs a master; else a
    :class:`MasterWeightsOptimizer` stepping fp32 masters in their place (the group dicts are changed in
    place, so an LR scheduler built on ``optimizer`` keeps steering the step). ``name_of(param)`` names a
    parameter in errors."""
    if isinstance(optimizer, MasterWeightsOptimizer):
        return optimizer
    low = [p for g in optimizer.param_groups for p in g["params"] if needs_master(p)]
    if not low:
        return optimizer
    if optimizer.state:
        raise ValueError(
            f"prepare(): parameter {name_of(low[0])!r} is {_dtype(low[0])} and trainable, so it gets an fp32 "
            "master copy, but the optimizer already stepped (its state is for the low-precision parameter); "
            "prepare the optimizer before its first step"
        )
    return MasterWeightsOptimizer(optimizer, name_of)


def master_names(
    optimizer: Any, named_parameters: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, master)`` for each master of ``optimizer`` whose model parameter is named in
    ``named_parameters``: a skipped step then names the parameter, not "param_groups[0][3]"."""
    masters = master_map(optimizer)
    return [(name, masters[id(p)]) for name, p in named_parameters if id(p) in masters]


def master_map(optimizer: Any) -> Mapping[int, torch.Tensor]:
    """``id(model parameter) -> its fp32 master`` for an optimizer made by :func:`with_master_weights`;
    empty for any other (clipping and unscaling look up the tensor holding the step's gradient here)."""
    return optimizer.masters if isinstance(optimizer, MasterWeightsOptimizer) else {}


def gather_grads(optimizer: Any) -> None:
    """Before unscale or step: the masters' gradients from their model parameters (a no-op for an optimizer
    without masters, and for the second call in a step)."""
    if isinstance(optimizer, MasterWeightsOptimizer):
        optimizer.gather_grads()


def refresh_params(optimizer: Any) -> None:
    """After the step (skipped or not): the model parameters from their masters (a no-op without masters)."""
    if isinstance(optimizer, MasterWeightsOptimizer):
        optimizer.refresh_params()


class MasterWeightsOptimizer(WrappedOptimizer):
    """The user's optimizer over fp32 masters of its trainable fp16/bf16 parameters.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's (the groups hold the masters);
    ``step()`` is its step; ``zero_grad()`` clears the model parameters' gradients too. It is an
    ``Optimizer`` subclass (whose ``__init__`` is not run) so that LR schedulers and the loss scaler take it.
    """

    # A fused optimizer (AdamW(fused=True)) takes the scale and the inf check as attributes set on the object the
    # scaler steps, which is this one, not the optimizer inside: the scaler unscales the fp32 masters and skips
    # the step itself instead (one host sync; the fused kernel still does the update).
    _step_supports_amp_scaling = False

    def __init__(  # noqa: D107
        self, optimizer: torch.optim.Optimizer, name_of: Callable[[torch.Tensor], str] = lambda p: "<unnamed>"
    ) -> None:
        self.__dict__["optimizer"] = optimizer
        self._name_of = name_of
        self.names: list[str] = []  # the model parameters' names, in the masters' order (for messages)
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.masters: dict[int, torch.Tensor] = {}
        self._gathered = False
        for group in optimizer.param_groups:
            group["params"] = self._swap(group["params"])

    def _swap(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for p in params:
            if needs_master(p):
                master = torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=True)
                self.pairs.append((p, master))
                self.names.append(self._name_of(p))
                self.masters[id(p)] = master
                p = master
            out.append(p)
        self._versions = [p._version for p, _ in self.pairs]
        return out

    def first_name(self) -> str:
        """The first parameter with a master, named (for refusals)."""
        return self.names[0]

    def first_dtype(self) -> str:
        return _dtype(self.pairs[0][0])

    # -- the step ------------------------------------------------------------------------------------

    def gather_grads(self) -> None:
        """Copy each model parameter's gradient to its master as fp32 (once per step; the scaler then
        unscales and checks the fp32 copy). A master whose parameter was written since the last refresh
        (``Tensor._version`` counts in-place writes: a ``load_state_dict``) is re-read first. No host sync."""
        if self._gathered:
            return
        with torch.no_grad():
            for i, (p, master) in enumerate(self.pairs):
                if p._version != self._versions[i]:
                    master.copy_(p)
                master.grad = None if p.grad is None else p.grad.to(torch.float32)
        self._gathered = True

    def refresh_params(self) -> None:
        """Round each master back into its model parameter and free the masters' gradients. No host sync."""
        with torch.no_grad():
            if self.pairs:  # one multi-tensor copy (it casts fp32 -> fp16/bf16) instead of a kernel per parameter
                params, masters = zip(*self.pairs)
                torch._foreach_copy_(list(params), list(masters))
            for _, master in self.pairs:
                master.grad = None
        self._versions = [p._version for p, _ in self.pairs]
        self._gathered = False

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- the optimizer's own surface -----------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.optimizer.add_param_group({**param_group, "params": self._swap(params)})

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict plus the masters (fp32, in the order of their parameters in the groups),
        so a resume continues from their full bits, not from the rounded model weights."""
        return {**self.optimizer.state_dict(), STATE_KEY: [m.detach().clone() for _, m in self.pairs]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop(STATE_KEY, None)
        if masters is not None and len(masters) != len(self.pairs):
            raise ValueError(
                f"load_state_dict: the state holds {len(masters)} fp32 master weights, this optimizer "
                f"{len(self.pairs)}; load the state of the same optimizer over the same model"
            )
        self.optimizer.load_state_dict(state_dict)
        with torch.no_grad():
            for i, (p, master) in enumerate(self.pairs):
                master.copy_(masters[i] if masters is not None else p)  # a state without masters: the model's
        self._versions = [p._version for p, _ in self.pairs]
        self._gathered = False

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_name_of"}  # a closure: not picklable

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._name_of = lambda p: "<unnamed>"

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer({self.optimizer!r}, {len(self.pairs)} fp32 masters)"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
