"""The Accelerator's files part, with accelerate's names: ``save_state`` / ``load_state``, the project folder,
automatic checkpoint naming and its hooks (all asked of its checkpoint manager,
:mod:`mixprec.checkpoint.manager`), the elastic resume, ``save_model`` (the HF layout,
:mod:`mixprec.accelerator.hf_weights`) and ``get_state_dict``.

:class:`RunFiles` is a part the :class:`~mixprec.accelerator.accelerator.Accelerator` owns and delegates to
(``accelerator.save_state(...)`` is ``accelerator._files.save_state(...)``); the distributed strategy decides
how each piece is gathered, sharded or written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.accelerator.hf_weights import save_model
from mixprec.accelerator.prepared import unwrap as unwrap_module
from mixprec.checkpoint.folder_checks import Registry
from mixprec.checkpoint.manager import CheckpointManager, check_checkpointable
from mixprec.strategies.restarts import agree_on_number, restarted_anywhere

if TYPE_CHECKING:
    from mixprec.accelerator.processes import Processes
    from mixprec.accelerator.project import ProjectConfiguration
    from mixprec.strategies.strategy import DistributedStrategy

logger = logging.getLogger("mixprec.accelerator")


class RunFiles:
    """Saving and loading an Accelerator's run (see the module doc): asks the checkpoint manager, the
    distributed strategy, and the processes part (the elastic resume's agreement)."""

    def __init__(
        self, checkpoints: CheckpointManager, registry: Registry, strategy: DistributedStrategy, processes: Processes
    ) -> None:
        self._checkpoints = checkpoints
        self._registry = registry  # what prepare() registered: register_for_checkpointing adds to it
        self._strategy = strategy
        self._processes = processes

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict()`` / ``load_state_dict()`` in ``save_state`` / ``load_state``.
        Raises ValueError listing every object that lacks them (by position), registering none."""
        check_checkpointable(objects)
        self._registry.custom.extend(objects)

    @property
    def project_configuration(self) -> ProjectConfiguration:
        """The ProjectConfiguration this Accelerator saves and logs by."""
        return self._checkpoints.project

    @property
    def project_dir(self) -> str | os.PathLike[str] | None:
        """The project folder (the ProjectConfiguration's project_dir): where save_state() with no path writes."""
        return self._checkpoints.project.project_dir

    @property
    def logging_dir(self) -> str | os.PathLike[str] | None:
        """Where trackers write their files (the ProjectConfiguration's logging_dir)."""
        return self._checkpoints.project.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets."""
        return self._checkpoints.project.iteration

    def save_state(
        self,
        output_dir: str | Path | None = None,
        safe_serialization: bool = True,
        *,
        extra_json: Mapping[str, Any] | None = None,
        async_save: bool = False,
    ) -> Path:
        """Save models, optimizers, schedulers, scaler, data positions and RNG states, atomically (see
        :mod:`mixprec.checkpoint.folder_format`); with no ``output_dir``, to the project's next automatic
        checkpoint, the oldest beyond ``total_limit`` deleted by the writer thread once it has landed
        (:mod:`mixprec.checkpoint.manager`; a synchronous save returns after that deletion, as accelerate's).
        ``safe_serialization=False`` writes the weights with torch.save. ``extra_json={"name": obj}`` adds
        ``name.json`` to the folder. Collective: call it on every process.
        ``async_save=True``: returns once the state's tensors are taken; a background thread copies them to host
        memory (the next optimizer step waits for that copy, not for the write), then writes and commits the
        folder (it appears when complete; ``wait_for_checkpoint()`` waits for it). Weights changed outside the
        prepared optimizer's step before that step would reach the checkpoint."""
        manager = self._checkpoints
        path = manager.save(
            output_dir, safe_serialization=safe_serialization, extra_json=extra_json, async_save=async_save
        )
        if not async_save and output_dir is None and manager.project.automatic_checkpoint_naming:
            manager.wait()  # accelerate's contract: at most total_limit folders once save_state() returns
        return path

    @property
    def checkpoints(self) -> CheckpointManager:
        """This Accelerator's checkpoint manager (the folder format, numbering, keep-k pruning on the writer
        thread, the hooks): what ``save_state`` / ``load_state`` ask, and what the Trainer asks directly."""
        return self._checkpoints

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous ``save_state`` has committed its folder; raise its failure on every
        process. Collective. ``load_state`` and ``end_training`` call it themselves."""
        self._checkpoints.wait()

    def load_state(self, input_dir: str | Path | None = None, *, map_location: str | None = None) -> dict[str, Any]:
        """Restore a folder written by ``save_state`` (either format; with no ``input_dir``, the project's newest
        automatic checkpoint) into the prepared objects (call after ``prepare``). Loads no pickled objects.
        ``map_location`` ("cpu" or "on_device", accelerate's values) is accepted: the state always lands on
        the devices of the parameters it belongs to. Collective."""
        return self._checkpoints.load(input_dir, map_location=map_location)

    def resume_after_restart(self) -> Path | None:
        """The elastic pattern in one line: when ``torchrun --max-restarts=N`` restarted this worker group (a
        process died; on any node), load the project's newest automatic checkpoint and return its folder;
        otherwise (a first start, or no checkpoint yet) load nothing and return None. The main process chooses
        the folder for all. Needs ``ProjectConfiguration(automatic_checkpoint_naming=True)``. Collective."""
        number = self._checkpoints.latest_number()  # every process checks the configuration; the main one's count
        if not restarted_anywhere(self._processes):
            return None
        number = agree_on_number(self._processes, number)
        if number < 0:
            logger.warning("restarted by the launcher, but no checkpoint was saved yet: starting afresh")
            return None
        folder = self._checkpoints.automatic().folder(number)
        self.load_state(folder)
        logger.warning("restarted by the launcher: resumed from %s", folder)
        return folder

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """``hook(models, weights, output_dir)`` before ``save_state`` writes (see
        :mod:`mixprec.checkpoint.manager`); returns a handle with ``remove()``."""
        return self._checkpoints.register_save_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """``hook(models, input_dir)`` before ``load_state`` loads; returns a handle with ``remove()``."""
        return self._checkpoints.register_load_hook(hook)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write ``model``'s full weights in the Hugging Face layout (``model.safetensors``, or shards and an
        index; see :mod:`mixprec.accelerator.hf_weights`), gathered through the distributed strategy (FSDP2
        included) and written by the main process. Collective: call it on every process."""
        model = unwrap_module(model)
        save_model(
            self._strategy, model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
        )

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """``model``'s full state dict on the main process (gathered under FSDP2: a collective), None on the
        others. ``unwrap`` is accepted for accelerate's scripts: the keys are the user's module's either way."""
        return self._strategy.model_state_dict(unwrap_module(model))
