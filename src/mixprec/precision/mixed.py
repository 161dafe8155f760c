"""Mixed precision with autocast: fp32 master weights, fp16 or bf16 compute where torch deems it safe."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from mixprec.precision.base import Precision, PrecisionNotSupportedError


class AutocastMixedPrecision(Precision):
    """Forward under ``torch.autocast(device.type, dtype=compute_dtype)``; parameters stay fp32."""

    # What to use where the device type has no autocast at all: only full precision runs there (naming
    # another autocast mode, as bf16 once named fp16, sends the user to a second refusal).
    alternative: ClassVar[str] = "fp32"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        super().check_supported(device)
        if not torch.amp.is_autocast_available(device.type):
            raise PrecisionNotSupportedError(
                f"precision {cls.name!r}: torch has no autocast for device type {device.type!r}; "
                f"use precision='{cls.alternative}' on this device"
            )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(**self.autocast_kwargs())


class Fp16MixedPrecision(AutocastMixedPrecision):
    """fp16 autocast. fp16 has 5 exponent bits (smallest subnormal 2^-24), so gradients need loss scaling."""

    name = "fp16"
    compute_dtype = torch.float16
    needs_loss_scaling = True
    hf_flags = (True, False)
    auto_candidate = True
    safety_rank = 2  # overflows past 65504: needs loss scaling


class Bf16MixedPrecision(AutocastMixedPrecision):
    """bf16 autocast. bf16 keeps fp32's exponent range, so no loss scaling is needed."""

    name = "bf16"
    compute_dtype = torch.bfloat16
    hf_flags = (False, True)
    auto_candidate = True
    safety_rank = 1  # fp32's range, fewer mantissa bits

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        super().check_supported(device)
        # including_emulation=False: emulated bf16 on pre-Ampere GPUs is slower than fp32, which defeats
        # the point of asking for it.
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise PrecisionNotSupportedError(
                f"precision 'bf16': the GPU {name!r} has no native bf16 support; "
                "use precision='fp16' (with loss scaling) or 'fp32'"
            )
