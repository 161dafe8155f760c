"""What ``Accelerator.prepare`` hands back: the user's module (its forward patched), and thin optimizer and
scheduler wrappers that route the step through the loss scaler and the accumulation schedule.

The model is *not* wrapped in another module: ``prepare`` returns the very object it was given, with an
instance-level ``forward`` that runs the original one under the precision's autocast (and, under DDP,
through the DDP wrapper that syncs gradients). So ``state_dict()`` keys, attributes, ``isinstance`` checks
and ``unwrap_model`` all see the user's module, as they would without mixprec.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.models.outputs import extract_loss
from mixprec.optim.wrapped import WrappedOptimizer

if TYPE_CHECKING:
    from mixprec.accelerator.gradients import GradientState
    from mixprec.accelerator.step_in_backward import BackwardStepper
    from mixprec.precision.base import Precision


PREPARED_FLAG = "_is_accelerate_prepared"
"""accelerate's marker on what ``prepare`` returned (True), which scripts and libraries written for it read."""


def _no_fence() -> None:
    """No asynchronous save to wait for (an optimizer or scheduler wrapped outside an Accelerator)."""


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


def _prepared_no_sync(self: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """``model.no_sync()``: DDP's, on the module ``prepare`` returned under DDP, where accelerate's prepared model
    (the DDP wrapper itself) has it and helpers call it (accelerate's ``LocalSGD``). On a copy: nothing to skip."""
    ddp = self.__dict__["_mixprec"].ddp
    return ddp.no_sync() if ddp is not None else contextlib.nullcontext()


def _begin_step(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (the first one), for a precision decided on the training step: a training forward
    (train mode, grad enabled) begins a step, which the precision may first decide on by running this very call
    (``Precision.begin_step``). A hook ahead of FSDP2's own, not code inside forward: each such call is a whole
    call of the module, its all-gathers and reshards included, before this call gathers anything."""
    prepared = module.__dict__.get("_mixprec")
    if prepared is None:  # released (handed to another Accelerator)
        return
    if module.training and torch.is_grad_enabled():
        loss_fn = lambda: trial_loss(module(*args, **kwargs))  # noqa: E731
        prepared.precision.begin_step(loss_fn, [module], batch=(args, kwargs))


def _prepared_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The original forward under autocast; floating outputs back in fp32. No host sync."""
    prepared: _Prepared = self.__dict__["_mixprec"]
    precision = prepared.precision
    try:
        with precision.autocast():
            # Without grad (evaluation) there is nothing to sync: skip DDP, whose forward may broadcast buffers.
            if prepared.ddp is not None and torch.is_grad_enabled():
                out = prepared.ddp(*args, **kwargs)
            else:
                out = self.__dict__["_mixprec_forward"](*args, **kwargs)
    except RuntimeError as err:  # torch's "mixed dtype" from inside a layer norm: say which parameter, and the fix
        why = precision.model_refusal(self) if "dtype" in str(err) else None
        if why is None:
            raise
        raise RuntimeError(f"{type(self).__name__}'s forward failed: {why}") from err
    return precision.convert_output(out)


def trial_loss(outputs: Any) -> torch.Tensor:
    """The loss of a forward's outputs for "auto"'s race: the model's own loss where it returns one (HF
    models given labels, the built-in GPT), else the sum of its floating outputs, whose backward costs what
    the user's loss's does up to the loss function itself."""
    from torch.utils._pytree import tree_leaves

    with contextlib.suppress(ValueError):  # no loss of its own
        return extract_loss(outputs)
    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError(
            "precision='auto' times the first training step, but the model's outputs hold no tensor that "
            "requires grad; name the precision (mixed_precision='bf16', 'fp16' or 'no')"
        )
    return torch.stack([t.float().sum() for t in leaves]).sum()


def patch_forward(module: torch.nn.Module, precision: Precision, ddp: torch.nn.Module | None = None) -> None:
    """Make ``module(...)`` run under ``precision``'s autocast (and through ``ddp`` when given).

    The original bound forward is kept as ``module._mixprec_forward``; ``deepcopy`` rebinds both bound
    methods to the copy, so copies behave.
    """
    module.__dict__["_mixprec_forward"] = module.forward
    module.__dict__["_mixprec"] = _Prepared(precision, ddp)
    module.__dict__[PREPARED_FLAG] = True
    module.__dict__["forward"] = types.MethodType(_prepared_forward, module)
    if ddp is not None:
        module.__dict__["no_sync"] = types.MethodType(_prepared_no_sync, module)
    if precision.pending:  # decided on the training step: its steps begin in the precision
        handle = module.register_forward_pre_hook(_begin_step, prepend=True, with_kwargs=True)
        module.__dict__["_mixprec_hook"] = handle


def is_prepared(module: torch.nn.Module) -> bool:
    return "_mixprec" in module.__dict__


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
    strip_forward(module)
    for key in ("_mixprec_forward", "_mixprec", PREPARED_FLAG, "no_sync"):
        module.__dict__.pop(key, None)


class PreparedOptimizer(WrappedOptimizer):
    """The user's optimizer, stepped through the loss scaler.

    ``step()`` is the precision strategy's ``optimizer_step`` (for fp16: unscale unless ``clip_grad_norm_``
    did, inf check, skip, the scale's update); on a micro-batch that only accumulates (inside
    ``accumulate`` before the last one) ``step()`` and ``zero_grad()`` do nothing. ``step_was_skipped``
    says whether the last step reached the parameters. Host syncs: one per step (the scaler's inf check),
    none when accumulating.

    Every other attribute (``param_groups``, ``state``, ``state_dict()``...) is the optimizer's own. It is
    an ``Optimizer`` subclass (whose ``__init__`` is not run) so that LR schedulers accept it.

    Public attributes: ``optimizer``, the optimizer this one steps (the precision's conversion of the
    user's, e.g. one keeping fp32 master weights), and ``source``, the one the user passed to ``prepare``.
    """

    _is_accelerate_prepared = True

    def __init__(  # noqa: D107
        self,
        optimizer: torch.optim.Optimizer,
        gradients: GradientState,
        source: torch.optim.Optimizer | None = None,
        stepper: BackwardStepper | None = None,
        fence: Callable[[], None] = _no_fence,
    ) -> None:
        # Optimizer.__init__ is deliberately not called: this object holds no parameters of its own.
        self.__dict__["optimizer"] = optimizer
        self.__dict__["source"] = source if source is not None else optimizer  # what the user passed
        self._gradients = gradients
        self.stepper = stepper  # step_in_backward: the hooks that already stepped each parameter
        self.step_was_skipped = False
        self._fence = fence  # an asynchronous save may still be copying the weights and moments: steps wait

    @property
    def _is_overflow(self) -> bool:
        """accelerate's name for ``step_was_skipped``, which its tests and some scripts read or set."""
        return self.step_was_skipped

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self.step_was_skipped = bool(value)

    def step(self, closure: Any = None) -> Any:
        gradients = self._gradients
        if not gradients.sync_gradients:
            return None
        precision = gradients.precision
        if precision.needs_loss_scaling and not gradients.backward_pending:
            raise RuntimeError(
                "optimizer.step() with no accelerator.backward(loss) since the last optimizer step: fp16 "
                "gradients must come from accelerator.backward(loss) (which scales the loss), not "
                "loss.backward(); and each backward feeds one optimizer step (for several optimizers on one "
                "loss, use one optimizer with several param_groups)"
            )
        kwargs = {} if closure is None else {"closure": closure}
        self._fence()
        if self.stepper is not None:  # every parameter was updated during backward: record the step
            if closure is not None:
                raise ValueError("optimizer.step(closure) with step_in_backward=True: the step ran in backward")
            result = None
            precision.end_step()
        else:
            result = precision.optimizer_step(self.optimizer, **kwargs)
        self.step_was_skipped = precision.step_was_skipped
        if self.source is not self.optimizer:
            # torch's LR schedulers warn "scheduler.step() before optimizer.step()" unless the optimizer they
            # were built on flags its steps; a precision that replaced it (bf16-pure) steps another object
            self.source._opt_called = True
        gradients.stepped(self)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gradients.sync_gradients:
            self._gradients.dropped(self)  # a step not taken: its unscale and inf check go with its gradients
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._fence()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._gradients.forget_owners()
        if self.stepper is not None:
            self.stepper.install()

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
    """The user's LR scheduler, advanced as HF Accelerate's ``AcceleratedScheduler`` is.

    With ``with_optimizer`` (``Accelerator(step_scheduler_with_optimizer=True)``, the default), ``step()`` does
    nothing on a micro-batch that only accumulates, nor after a step the scaler skipped (inf/NaN gradients;
    right for fused optimizers too, which skip on the device: the decision is read from the scaler's record,
    which costs no host sync); otherwise it advances ``per_step`` times (see
    :func:`~mixprec.accelerator.config.scheduler_rule`). Without ``with_optimizer`` (a schedule stepped per
    epoch, on a metric...), ``step()`` always advances the scheduler, once.
    """

    _is_accelerate_prepared = True

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[PreparedOptimizer],
        gradients: GradientState,
        *,
        with_optimizer: bool = True,
        per_step: int = 1,
        fence: Callable[[], None] = _no_fence,
    ) -> None:
        self.scheduler = scheduler
        self._optimizers = optimizers
        self._gradients = gradients
        self.with_optimizer = with_optimizer
        self.per_step = per_step
        self._fence = fence  # a learning rate held in a tensor is rewritten in place (an async save's copy)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._fence()
        if not self.with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._gradients.sync_gradients or self._step_was_skipped():
            return
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.per_step):
            # OneCycleLR raises one step past total_steps, which N steps per optimizer step reach on the last
            # batch of a DataLoader without drop_last: stop there, as accelerate does
            if total is not None and self.scheduler._step_count > total:
                return
            self.scheduler.step(*args, **kwargs)

    def _step_was_skipped(self) -> bool:
        if self._optimizers:
            return any(opt.step_was_skipped for opt in self._optimizers)
        return self._gradients.precision.step_was_skipped

    def __getattr__(self, name: str) -> Any:  # state_dict, load_state_dict, get_last_lr...: the scheduler's own
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"


def strip_forward(module: torch.nn.Module) -> None:
    """``unwrap_model(keep_fp32_wrapper=False)``: the module runs its class's forward again (no autocast, no
    fp32 outputs, no DDP sync through it), in place, as accelerate strips its own wrapper. It stays
    registered with its Accelerator (``save_state`` still saves it); preparing it again does not re-patch it."""
    hook = module.__dict__.pop("_mixprec_hook", None)
    if hook is not None:
        hook.remove()
    module.__dict__.pop("forward", None)


def prepared_with(module: torch.nn.Module) -> Precision | None:
    """The precision object ``module`` was prepared with (None when not prepared): tells an Accelerator a
    module it prepared before ``free_memory`` from one another Accelerator prepared."""
    prepared = module.__dict__.get("_mixprec")
    return None if prepared is None else prepared.precision


def unwrap(module: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> torch.nn.Module:
    """The user's module out of DDP / DataParallel (and ``torch.compile`` unless ``keep_torch_compile``, in
    which case the compiled wrapper comes back around the unwrapped module, as in accelerate)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    compiled = module if isinstance(getattr(module, "_orig_mod", None), torch.nn.Module) else None
    if compiled is not None:
        module = compiled._orig_mod
    while isinstance(module, (DataParallel, DistributedDataParallel)) or isinstance(
        getattr(module, "_orig_mod", None), torch.nn.Module
    ):
        module = getattr(module, "_orig_mod", None) or module.module
    if not keep_fp32_wrapper:
        strip_forward(module)
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = module
        return compiled
    return module
