"""The checkpoint manager (after torchtitan's ``CheckpointManager``): one object per Accelerator that owns its
checkpoint folders. ``Accelerator.save_state`` / ``load_state``, the Trainer's ``checkpoint-N`` saves and its
resume all go through it:

- the folder format and its load checks (:mod:`mixprec.checkpoint.folder_format`,
  :mod:`mixprec.checkpoint.folder_checks`), given the run's objects (:class:`RunState`) by the Accelerator;
- the numbering: accelerate's automatic naming from the project settings (``save_state()`` with no path
  writes ``<project_dir>/checkpoints/checkpoint_<iteration>``, ``load_state()`` reads the newest complete
  one); the Trainer passes its own naming (:func:`~mixprec.checkpoint.folders.trainer_folders`) with a save;
- keep-k pruning (:meth:`NumberedFolders.prune <mixprec.checkpoint.folders.NumberedFolders.prune>`), on the
  writer thread once the new folder has landed, for an asynchronous save as for a synchronous one: the
  training thread never deletes;
- the save/load pre-hooks, as accelerate's. ``save_hook(models, weights, output_dir)`` runs on the main
  process before the state is written; ``output_dir`` is the unfinished folder, so the files it adds are part
  of the atomic save and of the manifest. A hook that removes entries from ``weights`` (to save a model its
  own way, as diffusers' do) is refused, as is a load hook that removes models: every prepared model is saved
  and loaded with the rest of the state. ``load_hook(models, input_dir)`` runs on every process first.

Differences from accelerate's naming, both for crash safety: the oldest checkpoints are pruned *after* the new
one is committed (accelerate deletes first, so a crash mid-save could leave fewer than ``total_limit``, or
none), and ``load_state`` restores the iteration counter recorded in the folder, so a resumed run's next save
does not collide with the checkpoint it resumed from. A path given to ``save_state(path)`` is honoured even
with automatic naming on (accelerate ignores it); the counter advances either way.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from mixprec.checkpoint.background import BackgroundWriter
from mixprec.checkpoint.folder_checks import MODEL_DIR, RunState, name_of
from mixprec.checkpoint.folder_format import load_state, save_state
from mixprec.checkpoint.folders import NumberedFolders, automatic_folders
from mixprec.checkpoint.model_part import completed, saved_keys
from mixprec.checkpoint.safe_files import CheckpointError, load_json, load_tensors

logger = logging.getLogger("mixprec.accelerator")

ITERATION_FILE = "project"  # save_state(extra_json=...) key: ``project.json`` holds {"iteration": n}


class ProjectSettings(Protocol):
    """accelerate's ``ProjectConfiguration`` fields the numbering reads (read at each call: a script may
    change them, as ``accelerator.project_configuration.iteration = 0``)."""

    project_dir: Any
    automatic_checkpoint_naming: bool
    total_limit: int | None
    iteration: int


@dataclass(frozen=True)
class Keep:
    """Keep-k for one naming: after a save lands, ``folders.prune(limit, protect)`` on the writer thread."""

    folders: NumberedFolders
    limit: int | None
    protect: str | None = None
    """A folder never deleted (HF's best checkpoint); it counts among the ``limit``."""

    def prune(self) -> list[Path]:
        doomed = self.folders.prune(self.limit, protect=self.protect)
        if doomed:
            logger.info("deleted %d old checkpoint(s) of %s (keeping %s)", len(doomed), self.folders.root, self.limit)
        return doomed


class CheckpointManager:
    """The checkpoints of one Accelerator (see the module doc). ``run`` gives the objects a folder holds the
    state of (asked at each save and load: the precision may change when "auto" settles)."""

    def __init__(self, run: Callable[[], RunState], project: ProjectSettings) -> None:
        self._run = run
        self.project = project
        # OrderedDict, not dict: torch's RemovableHandle keeps a weak reference to its hook table
        self._save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._writer = BackgroundWriter()  # asynchronous saves and every prune: one job in flight at a time
        self.fence = self._writer.fence
        """Blocks while an asynchronous save still copies the live weights and moments (the prepared
        optimizer's and scheduler's steps call it first)."""

    # -- numbering -----------------------------------------------------------------------------------

    def automatic(self, call: str = "load_state()") -> NumberedFolders:
        """The automatic checkpoints, under the one numbered-folder policy the Trainer's share: a folder
        whose files are not all there (a damaged one) is neither loaded nor counted."""
        if self.project.project_dir is None:
            raise ValueError(
                f"{call} with no path needs a project folder: pass Accelerator(project_dir=...) or "
                "ProjectConfiguration(project_dir=...), or give the path"
            )
        return automatic_folders(self.project.project_dir)

    def latest_number(self) -> int:
        """The iteration of the project's newest complete automatic checkpoint, -1 if there is none."""
        if not self.project.automatic_checkpoint_naming:
            raise ValueError(
                "resume_after_restart() loads the newest automatic checkpoint: use Accelerator(project_config="
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)) and save_state() with no path"
            )
        folders = self.automatic()
        latest = folders.latest()
        return -1 if latest is None else folders.number_of(latest)  # type: ignore[return-value]

    def _next_automatic(self) -> Path:
        """Where ``save_state()`` writes next; refused if that folder exists (it would be replaced)."""
        target = self.automatic("save_state()").folder(self.project.iteration)
        if target.exists():
            raise ValueError(
                f"save_state(): {target} already exists (iteration {self.project.iteration}); load it first, which "
                "sets the iteration past it, or pass ProjectConfiguration(iteration=...) to start after it"
            )
        return target

    def _latest_automatic(self) -> Path:
        folders = self.automatic()
        latest = folders.latest()
        if latest is None:
            damaged = folders.numbered()
            why = f" ({len(damaged)} incomplete or damaged, skipped)" if damaged else ""
            raise FileNotFoundError(
                f"load_state(): no checkpoint_<n> folder in {folders.root}{why}; save_state() first, or give the path"
            )
        return latest

    # -- hooks ---------------------------------------------------------------------------------------

    def register_save_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` before a save writes (``Accelerator.register_save_state_pre_hook``)."""
        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def register_load_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` before a load (``Accelerator.register_load_state_pre_hook``)."""
        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    # -- save, wait, load ----------------------------------------------------------------------------

    def save(
        self,
        output_dir: str | Path | None = None,
        *,
        safe_serialization: bool = True,
        extra_json: Mapping[str, Any] | None = None,
        extra_torch: Mapping[str, Any] | None = None,
        async_save: bool = False,
        keep: Keep | None = None,
        pre_hook: Callable[[list[torch.nn.Module], list[Any], str], None] | None = None,
    ) -> Path:
        """Write one folder (collective). With no ``output_dir``: the project's next automatic checkpoint,
        pruned to ``total_limit``; else ``keep`` (the caller's naming and limit) says what to prune. The
        pruning runs on the writer thread after the folder is committed: :meth:`wait` waits for it too.
        ``pre_hook``: the caller's own save hook (the Trainer's peft files), called as the registered ones are,
        after them."""
        run = self._run()
        automatic = output_dir is None and self.project.automatic_checkpoint_naming
        if output_dir is None and not automatic:
            raise ValueError(
                "save_state() needs a folder: pass output_dir, or Accelerator(project_config="
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))"
            )
        target = self._next_automatic() if automatic else Path(output_dir)  # type: ignore[arg-type]
        extra = dict(extra_json or {})
        if automatic:
            if ITERATION_FILE in extra:
                raise ValueError(f"save_state(extra_json=...): {ITERATION_FILE!r} is reserved (the project iteration)")
            extra[ITERATION_FILE] = {"iteration": self.project.iteration}
            keep = Keep(self.automatic("save_state()"), self.project.total_limit)
        hooks = [*self._save_hooks.values(), *([pre_hook] if pre_hook is not None else [])]
        hook = self._pre_hook(run.registry.models, hooks) if hooks else None
        writer = self._writer if async_save else None
        if writer is None:  # a synchronous save after an asynchronous one: that one lands first
            self.wait()
        prune = keep.prune if keep is not None and keep.limit is not None and run.strategy.is_main_process else None
        path = save_state(
            run,
            target,
            extra,
            extra_torch=extra_torch,
            safe_serialization=safe_serialization,
            pre_hook=hook,
            writer=writer,
            landed=prune,
        )
        self.project.iteration += 1  # as accelerate: every save advances it
        if prune is not None and writer is None:  # committed: the writer deletes while training goes on
            self._writer.submit(prune, "mixprec-prune")
        run.strategy.barrier()
        return path

    def wait(self) -> None:
        """Collective: let the asynchronous save or the pruning in flight (if any) finish on the main process,
        and raise its failure on every process (CheckpointError elsewhere, the error itself on the main one)."""
        strategy = self._run().strategy
        error = self._writer.wait() if strategy.is_main_process else None
        if not strategy.all_true(error is None):
            raise error or CheckpointError(
                "an asynchronous save_state failed on the main process (see its error); the previous one is intact"
            )

    def _pre_hook(
        self, models: list[torch.nn.Module], hooks: list[Callable[..., None]]
    ) -> Callable[[Path, list[Any]], None]:
        def call_hooks(folder: Path, weights: list[Any]) -> None:
            given = list(weights)
            for hook in hooks:
                hook(list(models), weights, str(folder))
            if len(weights) != len(given):
                raise ValueError(
                    "a save_state pre-hook removed entries from `weights`: mixprec saves every prepared model "
                    "with the rest of the state (crash-safe, one folder); save extra files from the hook instead"
                )

        return call_hooks

    def load(self, input_dir: str | Path | None = None, *, map_location: str | None = None) -> dict[str, Any]:
        """Restore a folder (collective; with no ``input_dir``, the newest complete automatic checkpoint);
        all or nothing (see :func:`~mixprec.checkpoint.folder_format.load_state`). Returns its metadata."""
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
            path = self._latest_automatic()
        else:
            path = Path(input_dir).expanduser()
        run = self._run()
        models = list(run.registry.models)
        for hook in list(self._load_hooks.values()):
            hook(models, str(path))
        if len(models) != len(run.registry.models):
            raise ValueError(
                "a load_state pre-hook removed models from `models`: mixprec loads every prepared model with the "
                "rest of the state; load extra files from the hook instead"
            )
        self.wait()  # a save still being written (maybe of this very folder) lands first
        meta = load_state(run, path)
        self._restore_iteration(path)
        return meta

    def load_weights(self, folder: str | Path, model: torch.nn.Module) -> None:
        """Only ``model``'s weights out of a checkpoint folder (the Trainer's ``load_best_model_at_end``), through
        the distributed strategy: a sharded state's pieces on each process, else the main file, completed from
        the model itself where it holds a peft model's adapters only. Collective."""
        folder, strategy = Path(folder), self._run().strategy
        if (folder / MODEL_DIR.format(0)).is_dir():  # fsdp_state_dict_type="sharded": each process its pieces
            strategy.load_shards([model], [], folder)
            return
        path = folder / name_of("model", 0, "safetensors")
        if saved_keys(model) is None:
            read = lambda: load_tensors(path, device=strategy.device)  # noqa: E731
        else:  # a peft model's checkpoint holds its adapters: the frozen base is the model's own
            weights = completed(strategy, model, load_tensors(path, device=strategy.device))
            read = lambda: weights  # noqa: E731
        strategy.load_model_state_dict(model, read)

    def _restore_iteration(self, folder: Path) -> None:
        """After loading ``folder``: the next save goes after the one loaded (and never back below the
        current counter, so loading an older checkpoint mid-run does not aim at an existing folder)."""
        file = folder / f"{ITERATION_FILE}.json"
        if file.is_file():
            saved = load_json(file).get("iteration")
            if isinstance(saved, int):
                self.project.iteration = max(self.project.iteration, saved + 1)


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
