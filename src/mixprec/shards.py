"""A DTensor's local shard: under FSDP2 a parameter, its gradient and its optimizer state are DTensors, and
what a process computes on alone (a norm, a copy, an optimizer's arithmetic) is its own shard. The one place
that knows; a leaf (imports nothing from mixprec)."""

from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor (a view: writing it writes the DTensor), ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
