"""The one seam between the diagnosis and ``mixprec.precision``: names are parsed by the registry only.

The diagnosis needs three things from a precision name: its canonical name, an autocast context for it, and
whether this device can run it (``resolve_precision`` raises ``PrecisionNotSupportedError`` otherwise).
"""

from __future__ import annotations

import torch

from mixprec.precision.base import Precision, PrecisionNotSupportedError
from mixprec.precision.formats import FORMATS
from mixprec.precision.full import FullPrecision
from mixprec.precision.registry import autocast_format, resolve_precision

TargetPrecision = Precision
"""What the non-finite search runs under: anything with ``.name``, ``.compute_dtype`` and ``.autocast()``."""


def resolve_target(name: str, device: torch.device) -> Precision:
    """Parse ``name`` for ``device``. Raises ``ValueError`` for an unknown name and
    ``PrecisionNotSupportedError`` (a ``ValueError``) for one the device cannot run; never falls back."""
    p = resolve_precision(name, device=device)
    # fp32, or a plain autocast mode whose format has ranges here: a policy, pure bf16 or fp8 would need its
    # own judgement before it can be judged
    if not isinstance(p, FullPrecision) and autocast_format(p) not in FORMATS:
        handled = ", ".join([FullPrecision.name, *FORMATS])
        raise ValueError(f"precision {name!r} resolved to {p.name!r}; the diagnosis handles {handled}")
    return p


def try_resolve(name: str, device: torch.device) -> Precision | str:
    """Like :func:`resolve_target`, but returns the reason as a string when the device cannot run it."""
    try:
        return resolve_target(name, device)
    except PrecisionNotSupportedError as e:
        return str(e)
