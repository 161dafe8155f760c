"""Where ``save_state()`` with no path writes: HF Accelerate's ``ProjectConfiguration`` and its automatic
checkpoint naming (``{project_dir}/checkpoints/checkpoint_{iteration}``), with a limit on how many are kept; listing,
pruning and skipping damaged folders follow the one policy of :mod:`mixprec.checkpoint.folders`.

Differences from accelerate, both for crash safety: the oldest checkpoints are pruned *after* the new one is
committed (accelerate deletes first, so a crash mid-save could leave fewer than ``total_limit``, or none), and
``load_state`` restores the iteration counter recorded in the folder, so a resumed run's next save does not
collide with the checkpoint it resumed from. And a path given to ``save_state(path)`` is honoured even with
automatic naming on (accelerate ignores it and writes the next numbered folder); the counter advances either way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mixprec.checkpoint import load_json
from mixprec.checkpoint.folders import NumberedFolders

logger = logging.getLogger("mixprec.accelerator")

CHECKPOINTS = "checkpoints"
ITERATION_FILE = "project"  # save_state(extra_json=...) key: ``project.json`` holds {"iteration": n}
_REQUIRED = ("accelerator.json",)  # what every save_state folder holds (see accelerator/state.py)
_LEGACY = ("accelerator.json", "rng_state_0.pt")  # the same, for a folder written before manifests


@dataclass
class ProjectConfiguration:
    """``Accelerator(project_config=...)``: HF Accelerate's fields and meaning."""

    # str | None (a PathLike works too): what HfArgumentParser can parse, as accelerate's annotation.
    project_dir: str | None = None
    """Folder for the run's files; automatic checkpoints go to its ``checkpoints/`` subfolder."""

    logging_dir: str | None = None
    """Folder for local loggers' files (default: ``project_dir``)."""

    automatic_checkpoint_naming: bool = False
    """``save_state()`` / ``load_state()`` with no path write / read ``checkpoints/checkpoint_{iteration}``."""

    total_limit: int | None = None
    """Keep at most this many automatic checkpoints (the oldest are deleted); None keeps all."""

    iteration: int = 0
    """The number the next automatic checkpoint gets; incremented by every ``save_state``."""

    save_on_each_node: bool = False
    """Accepted for accelerate's scripts; mixprec assumes one filesystem shared by the processes that save."""

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)
        limit = self.total_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"ProjectConfiguration(total_limit={limit!r}): total_limit must be None or an int >= 1")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise ValueError(f"ProjectConfiguration(iteration={self.iteration!r}): iteration must be an int >= 0")

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when not given (as accelerate)."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    # -- automatic naming ----------------------------------------------------------------------------

    def _folder(self, call: str) -> Path:
        if self.project_dir is None:
            raise ValueError(
                f"{call} with no path needs a project folder: pass Accelerator(project_dir=...) or "
                "ProjectConfiguration(project_dir=...), or give the path"
            )
        return Path(self.project_dir) / CHECKPOINTS

    def folders(self, call: str = "load_state()") -> NumberedFolders:
        """The automatic checkpoints, under the one numbered-folder policy the Trainer's share: a folder
        whose files are not all there (a damaged one) is neither loaded nor counted."""
        return NumberedFolders(self._folder(call), "checkpoint_", required=_REQUIRED, legacy=_LEGACY)

    def checkpoint(self, number: int, call: str = "load_state()") -> Path:
        """The folder of automatic checkpoint ``number``."""
        return self.folders(call).folder(number)

    def latest_number(self) -> int:
        """The number of the newest complete automatic checkpoint, -1 if there is none."""
        folders = self.folders()
        latest = folders.latest()
        return -1 if latest is None else folders.number_of(latest)  # type: ignore[return-value]

    def next_checkpoint(self) -> Path:
        """Where ``save_state()`` writes next; refused if that folder exists (it would be replaced)."""
        target = self.checkpoint(self.iteration, "save_state()")
        if target.exists():
            raise ValueError(
                f"save_state(): {target} already exists (iteration {self.iteration}); load it first, which sets "
                "the iteration past it, or pass ProjectConfiguration(iteration=...) to start after it"
            )
        return target

    def latest_checkpoint(self) -> Path:
        """The newest complete automatic checkpoint (what ``load_state()`` with no path loads)."""
        folders = self.folders()
        latest = folders.latest()
        if latest is None:
            damaged = folders.numbered()
            why = f" ({len(damaged)} incomplete or damaged, skipped)" if damaged else ""
            raise FileNotFoundError(
                f"load_state(): no checkpoint_<n> folder in {folders.root}{why}; save_state() first, or give the path"
            )
        return latest

    def prune(self) -> list[Path]:
        """Delete the oldest complete automatic checkpoints beyond ``total_limit`` (main process, after a save
        has committed: a crash before this line leaves one more, never one fewer). Returns what was deleted."""
        doomed = self.folders("save_state()").prune(self.total_limit)
        if doomed:
            logger.info("save_state: deleted %d old checkpoint(s) (total_limit=%d)", len(doomed), self.total_limit)
        return doomed

    def restore_iteration(self, folder: Path) -> None:
        """After loading ``folder``: the next save goes after the one loaded (and never back below the
        current counter, so loading an older checkpoint mid-run does not aim at an existing folder)."""
        file = folder / f"{ITERATION_FILE}.json"
        if file.is_file():
            saved = load_json(file).get("iteration")
            if isinstance(saved, int):
                self.iteration = max(self.iteration, saved + 1)
