"""The one seam between the diagnosis and ``mixprec.precision``: names are parsed by the registry only.

The diagnosis needs three things from a precision name: its canonical name, an autocast context for it, and
whether this device can run it (``resolve_precision`` raises ``PrecisionNotSupportedError`` otherwise).
"""

from __future__ import annotations

import torch

from mixprec.precision.base import Precision, PrecisionNotSupportedError
from mixprec.precision.registry import resolve_precision

TargetPrecision = Precision
"""What the non-finite search runs under: anything with ``.name``, ``.compute_dtype`` and ``.autocast()``."""

_HANDLED = ("fp32", "fp16", "bf16")


def resolve_target(name: str, device: torch.device) -> Precision:
    """Parse ``name`` for ``device``. Raises ``ValueError`` for an unknown name and
    ``PrecisionNotSupportedError`` (a ``ValueError``) for one the device cannot run; never falls back."""
    p = resolve_precision(name, device=device)
    if p.name not in _HANDLED:  # a future mode ("fp8") needs its own format ranges before it can be judged
        raise ValueError(f"precision {name!r} resolved to {p.name!r}; the diagnosis handles {', '.join(_HANDLED)}")
    return p


def try_resolve(name: str, device: torch.device) -> Precision | str:
    """Like :func:`resolve_target`, but returns the reason as a string when the device cannot run it."""
    try:
        return resolve_target(name, device)
    except PrecisionNotSupportedError as e:
        return str(e)
