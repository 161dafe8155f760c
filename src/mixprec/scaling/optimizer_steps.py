"""The loss scaler's work on one optimizer: where it is in the step, its gradients unscaled and checked, and the
step of an optimizer that unscales and skips on its own (torch's fused Adam(W); the older ``grad_scaler=``
contract). :class:`~mixprec.scaling.scaler.GradScaler` holds the scale and the order of calls; these helpers
hold what it does to an optimizer's gradients. No function here forces a host sync except
:func:`nonfinite_grad_names` (the rare path)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from mixprec.scaling.unscale import check_and_unscale_


class Stage(Enum):
    """Where one optimizer is in the step (torch's READY -> UNSCALED -> STEPPED)."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass
class OptimizerState:
    optimizer: torch.optim.Optimizer
    stage: Stage = Stage.READY
    found_inf: torch.Tensor | None = None  # on the scale's device; > 0 means skip
    found_inf_host: bool | None = None  # set when step() already synced it


def unscale_grads(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    *,
    allow_fp16: bool,
    home: torch.device,
    param_names: Mapping[int, str],
    reducer: Callable[[torch.Tensor], None] | None,
) -> torch.Tensor:
    """One check-and-unscale per (device, dtype) group (torch's fused kernel where it takes the dtype,
    unscale.py otherwise); returns found_inf on ``home`` (the scale's device), reduced across processes by
    ``reducer`` when given. No host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if not allow_fp16 and param.grad.dtype == torch.float16:
                name = param_names.get(id(param), "a parameter")
                raise ValueError(
                    f"{name} has fp16 gradients, which cannot be unscaled safely: keep master weights in "
                    "fp32 (don't call model.half()) and let autocast run the fp16 compute"
                )
            grad = param.grad
            if grad.is_sparse:
                grad = grad.coalesce() if grad.dtype is torch.float16 else grad
                param.grad = grad
                grad = grad._values()
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    # found_inf must end as exactly 0.0 or 1.0: fused optimizers skip only when it equals 1.0 and subtract
    # it from their step counts, so a sum over dtype groups (2.0) applied the update with inf gradients.
    # The kernel writes 1.0 (it does not add), so one flag per device shared by its dtype groups is 0/1.
    flags: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), grads in groups.items():
            flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
            check_and_unscale_(grads, flag, inv_scale.to(device))  # torch's kernel, or exact staging
        if len(flags) == 1 and next(iter(flags)) == home:  # the usual case: nothing to combine
            found_inf = next(iter(flags.values()))
        else:
            found_inf = torch.zeros((), dtype=torch.float32, device=home)
            for flag in flags.values():
                torch.maximum(found_inf, flag.to(home, non_blocking=True), out=found_inf)
        if reducer is not None:
            reducer(found_inf)
            found_inf.clamp_(max=1.0)  # a SUM reducer would count ranks
    return found_inf


def fused_step(
    optimizer: torch.optim.Optimizer,
    state: OptimizerState,
    scale: torch.Tensor,
    check: Callable[[torch.Tensor], torch.Tensor],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The step of an optimizer that unscales and skips on the device (``fused=True``): it gets the scale (or
    None when the gradients were unscaled already) and an inf check made by ``check(inv_scale=1)``."""
    if state.stage is Stage.READY:
        state.found_inf = check(torch.ones((), dtype=torch.float32, device=scale.device))
    optimizer.grad_scale = None if state.stage is Stage.UNSCALED else scale
    optimizer.found_inf = state.found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale, optimizer.found_inf
        state.stage = Stage.STEPPED


def self_scaling_step(
    optimizer: torch.optim.Optimizer, state: OptimizerState, scaler: Any, *args: Any, **kwargs: Any
) -> Any:
    """torch's older contract for optimizers that declare ``_step_supports_amp_scaling`` and take
    ``grad_scaler=``: the optimizer gets the scaler itself and unscales/skips on its own (torch deprecates it,
    with this FutureWarning, in favour of the grad_scale/found_inf attributes :func:`fused_step` sets)."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the "
        "near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed "
        "optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=3,  # the caller of GradScaler.step()
    )
    try:
        return optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})
    finally:
        state.stage = Stage.STEPPED


def nonfinite_grad_names(optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]) -> list[str]:
    """Names of ``optimizer``'s parameters whose gradient holds inf/NaN (``param_groups[i][j]`` for one not in
    ``param_names``). One host sync: for the rare path (a skipped step), not for every step."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not params:
        return []
    with torch.no_grad():
        flags = torch.stack([~torch.isfinite(p.grad).all().to(params[0].device) for p in params])
    groups = optimizer.param_groups
    position = {id(p): f"param_groups[{i}][{j}]" for i, g in enumerate(groups) for j, p in enumerate(g["params"])}
    return [param_names.get(id(p), position[id(p)]) for p, bad in zip(params, flags.tolist()) if bad]
