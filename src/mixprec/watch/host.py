"""The two sides of attaching a precision watch to whatever runs the training step, as protocols.

:class:`WatchHost` is what the watch needs from the run: :meth:`PrecisionWatch.attach(host, model)
<mixprec.watch.watch.PrecisionWatch.attach>` takes any object with these members. The Accelerator is one
(``Accelerator(watch=...)`` hands itself in ``prepare``), so the watch never imports the Accelerator (a floor
above it), and a loop without an Accelerator can attach a watch through an object of its own.
:class:`HostedWatch` is what a host asks of the watch passed to it (``Accelerator(watch=PrecisionWatch(...))``,
or a watch of the user's own); a setting (``watch=50``) is built into a ``PrecisionWatch`` by the Accelerator.
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
    def device(self) -> torch.device:
        """Where the model runs: the watch's readings and step record are kept there."""

    @property
    def scaler(self) -> Any:
        """The loss scaler (or the non-finite guard): its scale and step record."""

    @property
    def precision(self) -> Precision:
        """The precision strategy running the step (its ``name``, and ``compute_format``: the range measured)."""

    @property
    def num_processes(self) -> int:
        """Processes training together: capsules and the skip replay run in one process only."""

    @property
    def project_dir(self) -> str | os.PathLike[str] | None:
        """The run folder capsules of bad steps go under (None: no capsule is written)."""

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per step: each micro-batch's loss is divided by it before scaling."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (the watch: its fallback list) in the run's checkpoints."""


class HostedWatch(Protocol):
    """What a host (the Accelerator) asks of the watch passed to it: nothing else is called."""

    def attach(self, host: WatchHost, model: torch.nn.Module) -> None:
        """Follow ``model``, which ``host`` runs (called when the host prepares it)."""

    def watch_optimizer(self, optimizer: Any) -> None:
        """Follow ``optimizer``'s steps (called when the host prepares it, after any conversion)."""
