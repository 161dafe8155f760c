"""``mixprec.autocast``: a precision (mode or per-op-kind policy) as a context manager, for plain torch loops."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from mixprec.precision.base import Precision
from mixprec.precision.registry import canonical_name, policy_name, resolve_precision


def autocast(
    precision: str | Precision = "bf16",
    device_type: str | None = None,
    fp32_ops: Sequence[str] | str | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """The forward-pass context of ``precision`` on ``device_type`` (default: the precision object's device,
    else CUDA where available, else the CPU)::

        with mixprec.autocast("bf16", fp32_ops=["attention"]):   # or "bf16:fp32_ops=attention"
            loss = model(x).loss
        loss.backward()

    ``precision`` is a name the registry parses (a ValueError lists the valid ones) or a ``Precision``
    (its own ``autocast()``). Only the forward's context: fp16 still needs a loss scaler
    (``mixprec.GradScaler``). No host sync. "auto" has no step to measure here and is refused.
    """
    if isinstance(precision, Precision):
        if fp32_ops:
            raise ValueError("autocast(fp32_ops=...): pass the kinds in the precision's name, not beside an object")
        return precision.autocast()
    name = canonical_name(policy_name(precision, fp32_ops))
    if name == "auto":
        raise ValueError(
            "autocast('auto'): auto is measured on a training step; name a mode ('bf16', 'fp16', "
            "'bf16:fp32_ops=attention') or pass the Accelerator's precision object"
        )
    device = torch.device(device_type) if device_type is not None else None
    return resolve_precision(name, device).autocast()
