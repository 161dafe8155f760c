"""``Accelerator.save_state`` / ``load_state`` as accelerate's scripts call them: automatic checkpoint naming
from the :class:`~mixprec.accelerator.project.ProjectConfiguration`, and the save/load pre-hooks
(``register_save_state_pre_hook``), around the crash-safe format of :mod:`mixprec.accelerator.state`.

Hooks, as in accelerate: ``save_hook(models, weights, output_dir)`` runs before the state is written and may
add files to ``output_dir``; here that is the unfinished folder, so its files are part of the atomic save
and of the manifest. It runs on the main process only (where a file should be written once). A hook that
removes entries from ``weights`` (to save a model its own way, as diffusers' do) is refused, as is a load
hook that removes models: every prepared model is saved and loaded with the rest of the state.
``load_hook(models, input_dir)`` runs on every process before anything is loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mixprec.accelerator.project import ITERATION_FILE, ProjectConfiguration
from mixprec.accelerator.state import RunState, load_state, save_state
from mixprec.checkpoint import CheckpointError
from mixprec.checkpoint.background import BackgroundWriter


class StateCheckpoints:
    """The project's naming and the registered hooks of one Accelerator."""

    def __init__(self, project: ProjectConfiguration) -> None:
        self.project = project
        # OrderedDict, not dict: torch's RemovableHandle keeps a weak reference to its hook table
        self._save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._writer = BackgroundWriter()  # save_state(async_save=True): one save in flight at a time
        self.fence = self._writer.fence
        """Blocks while an asynchronous save still copies the live weights and moments (the prepared
        optimizer's and scheduler's steps call it first)."""

    def register_save_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def register_load_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    def save(
        self,
        run: RunState,
        output_dir: str | Path | None,
        *,
        safe_serialization: bool,
        extra_json: Mapping[str, Any] | None,
        async_save: bool = False,
    ) -> Path:
        automatic = output_dir is None and self.project.automatic_checkpoint_naming
        if output_dir is None and not automatic:
            raise ValueError(
                "save_state() needs a folder: pass output_dir, or Accelerator(project_config="
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))"
            )
        target = self.project.next_checkpoint() if automatic else Path(output_dir)  # type: ignore[arg-type]
        extra = dict(extra_json or {})
        if automatic:
            if ITERATION_FILE in extra:
                raise ValueError(f"save_state(extra_json=...): {ITERATION_FILE!r} is reserved (the project iteration)")
            extra[ITERATION_FILE] = {"iteration": self.project.iteration}
        hook = self._pre_hook(run.registry.models) if self._save_hooks else None
        writer = self._writer if async_save else None
        if writer is None:  # a synchronous save after an asynchronous one: that one lands first
            self.wait(run)
        path = save_state(run, target, extra, safe_serialization=safe_serialization, pre_hook=hook, writer=writer)
        self.project.iteration += 1  # as accelerate: every save advances it
        if automatic and run.strategy.is_main_process:
            # after the commit (an asynchronous save: before it, so one more folder stays until the next save);
            # a crash before this leaves one too many, never none
            self.project.prune()
        run.strategy.barrier()
        return path

    def wait(self, run: RunState) -> None:
        """Collective: let the asynchronous save in flight (if any) finish on the main process, and raise its
        failure on every process (CheckpointError elsewhere, the error itself on the main one)."""
        error = self._writer.wait() if run.strategy.is_main_process else None
        if not run.strategy.all_true(error is None):
            raise (
                error
                if error is not None
                else CheckpointError(
                    "an asynchronous save_state failed on the main process (see its error); the previous one is intact"
                )
            )

    def _pre_hook(self, models: list[torch.nn.Module]) -> Callable[[Path, list[Any]], None]:
        def call_hooks(folder: Path, weights: list[Any]) -> None:
            given = list(weights)
            for hook in list(self._save_hooks.values()):
                hook(list(models), weights, str(folder))
            if len(weights) != len(given):
                raise ValueError(
                    "a save_state pre-hook removed entries from `weights`: mixprec saves every prepared model "
                    "with the rest of the state (crash-safe, one folder); save extra files from the hook instead"
                )

        return call_hooks

    def load(self, run: RunState, input_dir: str | Path | None, *, map_location: str | None = None) -> dict[str, Any]:
        if map_location not in (None, "cpu", "on_device"):
            raise TypeError(
                f"load_state(map_location={map_location!r}): unsupported optimizer map location; use 'cpu' or "
                "'on_device' (either way the state is loaded onto its parameters' devices)"
            )
        if input_dir is None:
            if not self.project.automatic_checkpoint_naming:
                raise ValueError(
                    "load_state() needs a folder: pass input_dir, or use "
                    "ProjectConfiguration(automatic_checkpoint_naming=True) to load the newest checkpoint"
                )
            path = self.project.latest_checkpoint()
        else:
            path = Path(input_dir).expanduser()
        models = list(run.registry.models)
        for hook in list(self._load_hooks.values()):
            hook(models, str(path))
        if len(models) != len(run.registry.models):
            raise ValueError(
                "a load_state pre-hook removed models from `models`: mixprec loads every prepared model with the "
                "rest of the state; load extra files from the hook instead"
            )
        self.wait(run)  # a save still being written (maybe of this very folder) lands first
        meta = load_state(run, path)
        self.project.restore_iteration(path)
        return meta

    def latest_number(self) -> int:
        """The iteration of the project's newest automatic checkpoint, -1 if there is none."""
        if not self.project.automatic_checkpoint_naming:
            raise ValueError(
                "resume_after_restart() loads the newest automatic checkpoint: use Accelerator(project_config="
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)) and save_state() with no path"
            )
        return self.project.latest_number()


def check_checkpointable(objects: tuple[Any, ...]) -> None:
    """``register_for_checkpointing``: ValueError listing, by position, every object without
    ``state_dict()`` / ``load_state_dict()`` (as accelerate words it), before any is registered."""
    bad = [
        f"- Item at index {i}, `{type(obj).__name__}`"
        for i, obj in enumerate(objects)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
    ]
    if bad:
        raise ValueError(
            "register_for_checkpointing: every object needs state_dict() and load_state_dict(); these lack them:\n"
            + "\n".join(bad)
        )
