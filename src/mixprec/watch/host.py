"""What a precision watch needs from whatever runs the training step: the attach protocol.

:meth:`PrecisionWatch.attach(host, model) <mixprec.watch.watch.PrecisionWatch.attach>` takes any object with
these members; the Accelerator is one (``Accelerator(watch=...)`` hands itself in ``prepare``), so the watch,
a layer above it, never imports it, and a loop without an Accelerator can attach a watch through an object of
its own.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

from mixprec.precision.base import Precision


class WatchHost(Protocol):
    """The run a watch attaches to: its device, step and folder (read once, at attach), its precision (read
    each step: "auto" decides on the first) and where checkpoints pick up the watch's state."""

    @property
    def device(self) -> torch.device: ...

    @property
    def scaler(self) -> Any:
        """The loss scaler (or the non-finite guard): its scale and step record."""

    @property
    def precision(self) -> Precision:
        """The precision strategy running the step (its ``name``, and ``compute_format``: the range measured)."""

    @property
    def num_processes(self) -> int: ...

    @property
    def project_dir(self) -> str | os.PathLike[str] | None:
        """The run folder capsules of bad steps go under (None: no capsule is written)."""

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per step: each micro-batch's loss is divided by it before scaling."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (the watch: its fallback list) in the run's checkpoints."""
