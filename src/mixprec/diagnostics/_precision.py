"""The one seam between the diagnosis and ``mixprec.precision`` for the user's target name: parsed by the
registry only.

The diagnosis needs three things from the target's name: its canonical name, an autocast context for it, and
whether this device can run it (``resolve_precision`` raises ``PrecisionNotSupportedError`` otherwise). The other
candidates come as objects (:func:`~mixprec.precision.registry.autocast_modes`), never looked up by name.
"""

from __future__ import annotations

import torch

from mixprec.precision.base import Precision
from mixprec.precision.full import FullPrecision
from mixprec.precision.registry import autocast_format, autocast_modes, resolve_precision


def resolve_target(name: str, device: torch.device) -> Precision:
    """Parse ``name`` for ``device``. Raises ``ValueError`` for an unknown name and
    ``PrecisionNotSupportedError`` (a ``ValueError``) for one the device cannot run; never falls back."""
    p = resolve_precision(name, device=device)
    # fp32, or a plain autocast mode whose format has ranges here: a policy, pure bf16 or fp8 would need its
    # own judgement before it can be judged
    if not isinstance(p, FullPrecision) and autocast_format(p) is None:
        handled = ", ".join([FullPrecision.name, *(m.name for m in autocast_modes(device))])
        raise ValueError(f"precision {name!r} resolved to {p.name!r}; the diagnosis handles {handled}")
    return p
