"""Settings that ``accelerate launch`` hands its processes through the environment.

A script moved from HF Accelerate by changing its import keeps being started with ``accelerate launch
--mixed_precision fp16 ...``; HF's Accelerator reads these variables when an argument is left at its default,
so mixprec's does too, or the launcher's fp16 would silently train in fp32. An argument given in the code
always wins, as in accelerate.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
DEVICE = "ACCELERATE_TORCH_DEVICE"
USE_CPU = "ACCELERATE_USE_CPU"
ACCUMULATION = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


def launcher_mixed_precision(environ: Mapping[str, str] = os.environ) -> str:
    """The launcher's precision name ("no" when it set none); parsed later by the precision registry."""
    return environ.get(MIXED_PRECISION, "no") or "no"


def launcher_device(environ: Mapping[str, str] = os.environ) -> str | None:
    """The device the launcher assigned this process, if any."""
    return environ.get(DEVICE) or None


def launcher_cpu(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the launcher asked for the CPU (``accelerate launch --cpu``)."""
    return environ.get(USE_CPU, "").strip().lower() in ("1", "true", "yes")


def launcher_accumulation(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """The launcher's gradient accumulation steps, when the code left the default of 1."""
    raw = environ.get(ACCUMULATION)
    if default != 1 or not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{ACCUMULATION}={raw!r}: the launcher's gradient accumulation steps must be an integer"
        ) from None
