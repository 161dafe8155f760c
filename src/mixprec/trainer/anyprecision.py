"""AdamW with its moments in any dtype, and optional Kahan summation: HF's ``optim="adamw_anyprecision"``.

HF's Trainer builds this from torchdistx's ``AnyPrecisionAdamW``, which no longer installs with current torch;
this is the same algorithm and the same options (names and defaults as HF passes them):

- ``momentum_dtype`` / ``variance_dtype``: storage of the two Adam moments. bfloat16 for both halves the
  optimizer state (8 -> 4 bytes per parameter) on fp32 master weights. The moment arithmetic runs in fp32 and
  is rounded to nearest on store.
- ``use_kahan_summation``: for parameters held in bf16/fp16 (as with ``precision="bf16-pure"``), keep what
  each update loses to rounding in a ``compensation_buffer_dtype`` buffer and add it back next step, so small
  updates are not lost (Zamirai et al. 2020). fp32 parameters have nothing to compensate at this scale and
  get no buffer.

One parameter at a time, so the fp32 temporaries are those of the largest tensor, not of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.optim.kahan import kahan_update_


class AnyPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments stored in ``momentum_dtype`` and ``variance_dtype``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        use_kahan_summation: bool = False,
        momentum_dtype: torch.dtype = torch.float32,
        variance_dtype: torch.dtype = torch.float32,
        compensation_buffer_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"AnyPrecisionAdamW(lr={lr!r}): must be >= 0")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "use_kahan_summation": use_kahan_summation,
            "momentum_dtype": momentum_dtype,
            "variance_dtype": variance_dtype,
            "compensation_buffer_dtype": compensation_buffer_dtype,
        }
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts every floating state to its parameter's dtype (fp32 moments after a resume
        would undo the saving): put the moments back in the dtypes their group asks for."""
        super().load_state_dict(state_dict)
        keys = {
            "exp_avg": "momentum_dtype",
            "exp_avg_sq": "variance_dtype",
            "compensation": "compensation_buffer_dtype",
        }
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                for key, dtype_key in keys.items():
                    if key in state:
                        state[key] = state[key].to(group[dtype_key])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update. No host sync (the step counter is a host float)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AnyPrecisionAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=group["momentum_dtype"])
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=group["variance_dtype"])
                    if group["use_kahan_summation"] and p.dtype != torch.float32:
                        state["compensation"] = torch.zeros_like(p, dtype=group["compensation_buffer_dtype"])
                state["step"] += 1
                _update(p, state, group, float(state["step"]))
        return loss


def _update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: float) -> None:
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    grad = p.grad.float()
    # out of place: .float() of an fp32 moment is the moment itself, and m and v are consumed below
    m = state["exp_avg"].float().lerp(grad, 1 - beta1)
    v = state["exp_avg_sq"].float().mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    state["exp_avg"].copy_(m)
    state["exp_avg_sq"].copy_(v)
    denom = v.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
    update = m.div_(denom).mul_(-lr / (1 - beta1**step))  # m is a temporary from here
    w = p.float()
    if wd:
        update.add_(w, alpha=-lr * wd)  # decoupled: from the weight before this step, as torch's AdamW
    comp = state.get("compensation")
    if comp is None:
        p.copy_(w.add_(update))
        return
    kahan_update_(p, w, update, comp)
