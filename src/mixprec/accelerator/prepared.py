"""What ``Accelerator.prepare`` hands back: the user's module (its forward patched), and thin optimizer and
scheduler wrappers that route the step through the loss scaler and the accumulation schedule.

The model is *not* wrapped in another module: ``prepare`` returns the very object it was given, with an
instance-level ``forward`` that runs the original one under the precision's autocast (and, under DDP,
through the DDP wrapper that syncs gradients). So ``state_dict()`` keys, attributes, ``isinstance`` checks
and ``unwrap_model`` all see the user's module, as they would without mixprec.
"""

from __future__ import annotations

import copy
import types
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mixprec.accelerator.gradients import GradientState
    from mixprec.precision.base import Precision


class _Prepared:
    """A prepared module's forward needs: its precision and, under DDP, the wrapper that syncs gradients.

    A copy of the module (``copy.deepcopy`` for an EMA, a pickle) keeps the precision but not the wrapper:
    the copy runs its own forward, under autocast, and never joins the original's gradient sync.
    """

    __slots__ = ("precision", "ddp")

    def __init__(self, precision: Precision, ddp: torch.nn.Module | None = None) -> None:
        self.precision = precision
        self.ddp = ddp

    def __deepcopy__(self, memo: dict[int, Any]) -> _Prepared:
        return _Prepared(copy.deepcopy(self.precision, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Prepared, (self.precision,))


def _prepared_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The original forward under autocast; floating outputs back in fp32. No host sync."""
    prepared: _Prepared = self.__dict__["_mixprec"]
    precision = prepared.precision
    with precision.autocast():
        # Without grad (evaluation) there is nothing to sync: skip DDP, whose forward may broadcast buffers.
        if prepared.ddp is not None and torch.is_grad_enabled():
            out = prepared.ddp(*args, **kwargs)
        else:
            out = self.__dict__["_mixprec_forward"](*args, **kwargs)
    return precision.convert_output(out)


def patch_forward(module: torch.nn.Module, precision: Precision, ddp: torch.nn.Module | None = None) -> None:
    """Make ``module(...)`` run under ``precision``'s autocast (and through ``ddp`` when given).

    The original bound forward is kept as ``module._mixprec_forward``; ``deepcopy`` rebinds both bound
    methods to the copy, so copies behave.
    """
    if is_prepared(module):
        raise ValueError(f"{type(module).__name__} was already prepared; prepare each model once")
    module.__dict__["_mixprec_forward"] = module.forward
    module.__dict__["_mixprec"] = _Prepared(precision, ddp)
    module.__dict__["forward"] = types.MethodType(_prepared_forward, module)


def is_prepared(module: torch.nn.Module) -> bool:
    return "_mixprec" in module.__dict__


def prepared_precision(module: torch.nn.Module) -> Precision | None:
    """The precision a prepared module runs under (None when not prepared): each Accelerator has its own, so
    this tells which Accelerator prepared it."""
    prepared = module.__dict__.get("_mixprec")
    return None if prepared is None else prepared.precision


def release(module: torch.nn.Module) -> None:
    """Undo :func:`patch_forward`: ``module`` runs its own forward again and another Accelerator may prepare it
    (a model trained by one Trainer, then by another). Refused for a module wrapped for DDP: its gradient
    hooks (or shards) belong to the first wrapper."""
    prepared = module.__dict__.get("_mixprec")
    if prepared is None:
        return
    from torch.distributed.fsdp import FSDPModule

    if prepared.ddp is not None or isinstance(module, FSDPModule):
        raise ValueError(
            f"{type(module).__name__} is prepared for DDP/FSDP by another Accelerator; in a "
            "distributed run build each model once per Accelerator (e.g. Trainer(model_init=...))"
        )
    for key in ("forward", "_mixprec_forward", "_mixprec"):
        module.__dict__.pop(key, None)


def original_forward(module: torch.nn.Module) -> Any:
    """The forward ``module`` had before ``prepare`` (no autocast)."""
    return module.__dict__.get("_mixprec_forward", module.forward)


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped through the loss scaler.

    ``step()`` is ``scaler.step(optimizer)`` (unscale unless ``clip_grad_norm_`` did, inf check, skip) and
    ``scaler.update()``; on a micro-batch that only accumulates (inside ``accumulate`` before the last one)
    ``step()`` and ``zero_grad()`` do nothing. ``step_was_skipped`` says whether the last step reached the
    parameters. Host syncs: one per step (the scaler's inf check), none when accumulating.

    Every other attribute (``param_groups``, ``state``, ``state_dict()``...) is the optimizer's own. It is
    an ``Optimizer`` subclass (whose ``__init__`` is not run) so that LR schedulers accept it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradients: GradientState) -> None:  # noqa: D107
        # Optimizer.__init__ is deliberately not called: this object holds no parameters of its own.
        self.__dict__["optimizer"] = optimizer
        self._gradients = gradients
        self.step_was_skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:
        gradients = self._gradients
        if not gradients.sync_gradients:
            return None
        scaler = gradients.scaler
        if scaler.is_enabled() and not gradients.backward_pending:
            raise RuntimeError(
                "optimizer.step() with no accelerator.backward(loss) since the last optimizer step: fp16 "
                "gradients must come from accelerator.backward(loss) (which scales the loss), not "
                "loss.backward(); and each backward feeds one optimizer step (for several optimizers on one "
                "loss, use one optimizer with several param_groups)"
            )
        result = scaler.step(self.optimizer) if closure is None else scaler.step(self.optimizer, closure=closure)
        scaler.update()
        self.step_was_skipped = scaler.record.last_step_skipped
        gradients.stepped(self)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gradients.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._gradients.forget_owners()

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """The user's LR scheduler, advanced only when its optimizer really stepped.

    ``step()`` does nothing on a micro-batch that only accumulates, nor after a step the scaler skipped
    (inf/NaN gradients; right for fused optimizers too, which skip on the device: the decision is read from
    the scaler's record, which costs no host sync). One ``step()`` per optimizer step, whatever the number
    of processes (unlike HF Accelerate, which steps it once per process).
    """

    def __init__(self, scheduler: Any, optimizers: list[PreparedOptimizer], gradients: GradientState) -> None:
        self.scheduler = scheduler
        self._optimizers = optimizers
        self._gradients = gradients

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._gradients.sync_gradients or self._step_was_skipped():
            return
        self.scheduler.step(*args, **kwargs)

    def _step_was_skipped(self) -> bool:
        if self._optimizers:
            return any(opt.step_was_skipped for opt in self._optimizers)
        return self._gradients.scaler.record.last_step_skipped

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"
