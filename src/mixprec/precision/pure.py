"""Pure bf16: parameters, gradients and optimizer states all in bf16 — 8 bytes per parameter instead of 16.

Autocast's mixed modes keep fp32 master weights (4 bytes), fp32 gradients (4) and fp32 Adam moments (8).
Here the module is converted to bf16 (its fp32 copy is not kept), so gradients and moments are bf16 too,
and the update goes through :class:`~mixprec.optim.Bf16AdamW`, which computes in fp32 and writes back with
stochastic rounding (``bf16-pure``) or Kahan-compensated summation (``bf16-pure-kahan``, +2 bytes per
parameter): plain round-to-nearest loses updates smaller than half a bf16 ulp (see that module).

The forward still runs under bf16 autocast, whose fp32 list keeps softmax, norms and losses in fp32 (as in
Lightning's "bf16-true", the model's own matmuls run in bf16 with no casts). No loss scaling: bf16 has
fp32's range. Not an "auto" candidate: it trades accuracy margins for memory, a choice for the user.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from mixprec.optim import Bf16AdamW
from mixprec.precision.base import PrecisionNotSupportedError
from mixprec.precision.mixed import Bf16MixedPrecision


class PureBf16Precision(Bf16MixedPrecision):
    """bf16 everywhere; updates with stochastic rounding."""

    name = "bf16-pure"
    param_dtype = torch.bfloat16
    auto_candidate = False
    hf_flags = (False, False)  # HF's bf16 flag is bf16 autocast with fp32 weights, which this is not
    rounding: ClassVar[str] = "stochastic"
    """The rounding of the optimizer this mode makes (a Bf16AdamW passed in keeps its own: ``update_rounding``)."""
    _ROUNDING_TEXT: ClassVar[dict[str, str]] = {
        "stochastic": "updates with stochastic rounding",
        "kahan": "updates with Kahan-compensated summation",
        "nearest": "updates rounded to nearest (small updates are lost)",
    }

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module's floating parameters and buffers in bf16, in place (the Parameter objects an optimizer
        holds stay the same; their fp32 data is freed). A frozen fp16 parameter stays as it is (a half-precision
        base under adapters: rounding it to bf16 would lose 3 mantissa bits, and it is never updated);
        autocast runs its matmuls in bf16 all the same."""
        with torch.no_grad():
            for p in module.parameters():
                frozen_half = p.dtype == torch.float16 and not p.requires_grad
                if p.is_floating_point() and p.dtype != torch.bfloat16 and not frozen_half:
                    p.data = p.data.to(torch.bfloat16)
                    if p.grad is not None:
                        p.grad = p.grad.to(torch.bfloat16)
            for sub in module.modules():
                for name, buffer in sub.named_buffers(recurse=False):
                    if buffer.is_floating_point():
                        setattr(sub, name, buffer.to(torch.bfloat16))
        return module

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An Adam/AdamW becomes a :class:`~mixprec.optim.Bf16AdamW` over the same parameter groups (the very
        group dicts, so an LR scheduler built on the original keeps steering it); torchao's 8/4-bit AdamW
        (``optim="adamw_torch_8bit"``) keeps its quantised states and rounds the bf16 weights with its own
        stochastic rounding (about 6 bytes per parameter in all)."""
        if isinstance(optimizer, Bf16AdamW):  # the user's own: its rounding, not this mode's, is the truth
            self._note_rounding({g.get("rounding", self.rounding) for g in optimizer.param_groups})
            return optimizer
        kind = type(optimizer)
        if hasattr(optimizer, "bf16_stochastic_round"):  # torchao's Adam family (8/4-bit states): its own SR
            if self.rounding != "stochastic":
                raise ValueError(
                    f"precision={self.name!r}: {kind.__name__} rounds bf16 weights stochastically, not with "
                    "Kahan summation; use precision='bf16-pure' with it"
                )
            optimizer.bf16_stochastic_round = True
            self._states = f"{kind.__name__}'s quantised Adam states"  # said as they are, not as this mode's own
            self._note_rounding({"stochastic"})
            return optimizer
        if kind not in (torch.optim.AdamW, torch.optim.Adam):
            raise ValueError(
                f"precision={self.name!r} updates bf16 weights with its own Adam/AdamW (rounding: {self.rounding}); "
                f"got {kind.__name__}: pass torch.optim.AdamW or Adam, or use precision='bf16' (fp32 master weights)"
            )
        if optimizer.state:
            raise ValueError(
                f"precision={self.name!r}: prepare the optimizer before its first step (it already holds fp32 state)"
            )
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(flag):
                    raise ValueError(f"precision={self.name!r}: {kind.__name__}({flag}=True) is not supported")
        decoupled = kind is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay"))
        new = Bf16AdamW([{"params": []}], decoupled=decoupled, rounding=self.rounding)
        new.param_groups = optimizer.param_groups  # shared dicts: schedulers on the original still apply
        for group in new.param_groups:
            group["decoupled"] = decoupled
            group["rounding"] = self.rounding
        new.defaults = {**optimizer.defaults, "decoupled": decoupled, "rounding": self.rounding}
        self._note_rounding({self.rounding})
        return new

    @property
    def update_rounding(self) -> str:  # type: ignore[override]
        """The rounding of the optimizer actually prepared (this mode's own until one is; "mixed" when a
        user's optimizer rounds its groups differently)."""
        return self._rounding

    def _note_rounding(self, roundings: set[str]) -> None:
        self._rounding = roundings.pop() if len(roundings) == 1 else "mixed"
        if self._default_reason:
            self.reason = self._reason_text()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "update": self._update_text()}

    def __init__(self, device: torch.device | str | None = None, reason: str = "") -> None:
        self._rounding = self.rounding
        self._states = ""  # the optimizer's own states, where a prepared one keeps them otherwise than in bf16
        super().__init__(device, reason)
        self._default_reason = not reason
        if not reason:
            self.reason = self._reason_text()

    def _update_text(self) -> str:
        return self._ROUNDING_TEXT.get(self._rounding, "updates with per-group rounding (the optimizer's own)")

    def _reason_text(self) -> str:
        if self._states:  # torchao's 8/4-bit states: about 6 or 5 bytes per parameter in all
            return f"{self.name} was asked for: parameters and gradients in bf16, {self._states}; {self._update_text()}"
        kahan = " + 2 for the compensation" if self._rounding == "kahan" else ""
        return (
            f"{self.name} was asked for: parameters, gradients and Adam states in bf16 (8 bytes per "
            f"parameter{kahan}); {self._update_text()}"
        )

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        try:
            super().check_supported(device)
        except PrecisionNotSupportedError as err:
            raise PrecisionNotSupportedError(str(err).replace("'bf16'", repr(cls.name))) from None


class PureBf16KahanPrecision(PureBf16Precision):
    """bf16 everywhere; updates with Kahan-compensated summation."""

    name = "bf16-pure-kahan"
    rounding = "kahan"
