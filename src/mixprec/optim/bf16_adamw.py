"""AdamW for bf16 parameters whose small updates are not lost: stochastic rounding or Kahan summation.

A bf16 parameter has 8 bits of mantissa: an update smaller than half a unit in the last place (|w| x 2^-9)
rounds back to the same value, so late in training, with small learning rates, round-to-nearest silently
stops learning (Zamirai et al. 2020, "Revisiting BFloat16 Training"). Two remedies, both keeping 2 bytes per
parameter and per Adam moment:

- ``rounding="stochastic"``: round the fp32 result up or down with probability proportional to the distance,
  so updates are unbiased in expectation (Gupta et al. 2015). The random bits come from torch's generator of
  the parameter's device, so checkpointed RNG states make a resumed run exact.
- ``rounding="kahan"``: keep the rounding error of each update in a bf16 compensation buffer and add it back
  next step (Kahan summation; +2 bytes per parameter).
- ``rounding="nearest"``: plain bf16, for comparison: what loses the small updates.

The update itself is computed in fp32 one parameter at a time, so the fp32 temporaries are those of the
largest tensor, not of the model. Moments are stored in the parameter's dtype (bf16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

ROUNDINGS = ("stochastic", "kahan", "nearest")
_HIGH_MASK = -65536  # 0xFFFF0000 as int32: keeps sign, exponent and the 7 mantissa bits bf16 holds


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write fp32 ``src`` into bf16 ``dst`` with stochastic rounding: the 16 bits bf16 drops are replaced
    by a random carry (probability = dropped bits / 2^16). Exact bf16 values pass unchanged."""
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    # integer addition on the bit pattern rounds the magnitude up, for negative numbers too; a carry out of
    # the mantissa bumps the exponent, which is the correctly rounded value
    rounded = (bits + noise).bitwise_and_(_HIGH_MASK).view(torch.float32)
    dst.copy_(rounded)  # exact: the low 16 bits are zero


class Bf16AdamW(torch.optim.Optimizer):
    """Adam / AdamW over bf16 (or any low-precision) parameters with fp32 arithmetic and a rounding rule.

    Args as ``torch.optim.AdamW`` (``decoupled=False`` gives ``torch.optim.Adam``'s L2 weight decay), plus
    ``rounding`` ("stochastic", "kahan" or "nearest"). Parameters may also be fp32, in which case the rule
    is irrelevant and the update is AdamW's.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
        rounding: str = "stochastic",
    ) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"Bf16AdamW(rounding={rounding!r}): choose one of {', '.join(ROUNDINGS)}")
        if not 0.0 <= lr:
            raise ValueError(f"Bf16AdamW(lr={lr!r}): lr must be >= 0")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "decoupled": decoupled,
                    "rounding": rounding}  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["rounding"] == "kahan" and p.dtype != torch.float32:
                        state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                _adamw_update(p, state, group, lr, beta1, beta2, eps, wd, step)
        return loss


def _adamw_update(
    p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], lr: float, beta1: float, beta2: float,
    eps: float, wd: float, step: float,
) -> None:  # fmt: skip
    grad = p.grad.float()
    w = p.float()
    if wd and not group["decoupled"]:
        grad = grad.add(w, alpha=wd)  # Adam's L2 decay enters the moments
    m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
    v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    state["exp_avg"].copy_(m)
    state["exp_avg_sq"].copy_(v)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = v.sqrt_().div_(math.sqrt(bias2)).add_(eps)
    update = m.div_(denom).mul_(-lr / bias1)  # m is a temporary now
    if wd and group["decoupled"]:
        update.add_(w, alpha=-lr * wd)
    if p.dtype == torch.float32:
        p.add_(update)
    elif group["rounding"] == "stochastic":
        stochastic_round_(p, w.add_(update))
    elif group["rounding"] == "kahan":
        comp = state["compensation"]
        y = update.sub_(comp.float())  # the update plus what earlier roundings lost
        new = (w + y).to(p.dtype)  # round to nearest
        comp.copy_(new.float().sub_(w).sub_(y))  # what this rounding lost (negated), kept for next step
        p.copy_(new)
    else:
        p.copy_(w.add_(update))
