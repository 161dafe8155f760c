"""Numbered checkpoint folders, one owner (after torchtitan's ``CheckpointManager``): which exist, which are
complete, which is the newest, what a crash left half-committed, and which to delete.

Both namings of mixprec go through :class:`NumberedFolders`, so they cannot drift apart: the Trainer's
``<output_dir>/checkpoint-<step>`` (:func:`trainer_folders`: the Trainer, the command line's run folders and the
watch's capsules all list through it) and the Accelerator's automatic
``<project_dir>/checkpoints/checkpoint_<n>`` (:func:`automatic_folders`, accelerate's name). The rules are the
same for both: listing skips a folder that does not look complete (:func:`looks_complete`: sizes, no bytes
read), a resume takes the newest folder whose every byte verifies (:meth:`NumberedFolders.find_resumable`), and
:meth:`NumberedFolders.prune` is the one keep-k policy, run once the new folder has landed (a crash before it
leaves one folder too many, never one too few).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.checkpoint.atomic import recover, unfinished_target
from mixprec.checkpoint.folder_checks import META, folder_problem
from mixprec.checkpoint.manifest import read_manifest
from mixprec.checkpoint.safe_files import CheckpointError

logger = logging.getLogger("mixprec.checkpoint")

_DELETING = ".deleting"

TRAINER_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state"
"""``trainer_state.json``: HF's TrainerState (a ``save_state(extra_json=...)`` key, as the next two)."""
TRAINER_EXTRA = "trainer_extra"
"""``trainer_extra.json``: the Trainer's data position and running-loss window (an exact resume)."""
TRAINER_ARGS = "training_args"
"""``training_args.json``: the run's arguments, for people (only its length, epochs or max_steps, is read back: by
a resume with another number of processes, mixprec.trainer.world_change)."""
TRAINER_REQUIRED = (META, f"{TRAINER_STATE}.json", f"{TRAINER_EXTRA}.json")
AUTOMATIC_DIR = "checkpoints"
AUTOMATIC_PREFIX = "checkpoint_"


def looks_complete(path: str | os.PathLike[str], required: Iterable[str] = (), legacy: Iterable[str] = ()) -> bool:
    """A folder that looks whole, without reading any file: its manifest lists ``required`` and every file it
    lists is there with the listed size; a folder without a manifest (written before manifests) holds every
    ``legacy`` file (``required`` when ``legacy`` is empty)."""
    path = Path(path)
    try:
        files = read_manifest(path)
    except (OSError, ValueError):
        return False
    if files is None:
        return path.is_dir() and all((path / name).is_file() for name in (tuple(legacy) or tuple(required)))
    try:
        return all(name in files for name in required) and all(
            (path / rel).stat().st_size == entry.get("size") for rel, entry in files.items()
        )
    except (OSError, AttributeError):  # a listed file gone, or an entry that is not a table
        return False


class NumberedFolders:
    """The folders ``<root>/<prefix><n>`` of one run. ``required`` / ``legacy``: see :func:`looks_complete`."""

    def __init__(
        self, root: str | os.PathLike[str], prefix: str, *, required: Iterable[str] = (), legacy: Iterable[str] = ()
    ) -> None:
        self.root = Path(root)
        self.prefix = prefix
        self.required = tuple(required)
        self.legacy = tuple(legacy)
        self._name = re.compile(rf"{re.escape(prefix)}(\d+)")

    def number_of(self, path: str | os.PathLike[str]) -> int | None:
        """n for a folder named ``<prefix><n>`` (wherever it lies), else None."""
        match = self._name.fullmatch(Path(path).name)
        return int(match.group(1)) if match else None

    def folder(self, number: int) -> Path:
        """The path of folder ``number`` (which need not exist)."""
        return self.root / f"{self.prefix}{number}"

    def unfinished_holding(self, filename: str | os.PathLike[str] | None) -> Path | None:
        """The numbered folder whose unfinished copy holds ``filename`` (a file a failed save was writing), None
        for any other file."""
        name = unfinished_target(filename) if filename else None
        number = self.number_of(name) if name else None
        return self.folder(number) if number is not None else None

    def is_complete(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` looks complete (sizes only; :meth:`verify` reads every byte)."""
        return looks_complete(path, self.required, self.legacy)

    def numbered(self) -> list[Path]:
        """Every ``<prefix><n>`` folder, complete or not, oldest (lowest n) first."""
        if not self.root.is_dir():
            return []
        found = [(n, p) for p in self.root.iterdir() if (n := self.number_of(p)) is not None and p.is_dir()]
        return [p for _, p in sorted(found)]

    def complete(self) -> list[Path]:
        """The complete folders (:meth:`is_complete`), oldest first."""
        return [p for p in self.numbered() if self.is_complete(p)]

    def latest(self) -> Path | None:
        """The newest complete folder, None if there is none."""
        found = self.complete()
        return found[-1] if found else None

    def has_any(self) -> bool:
        """Whether the root holds a numbered folder, or one a crash left renamed aside (``.<prefix>n.old``)."""
        if not self.root.is_dir():
            return False
        return any(self.number_of(p) is not None or self._aside(p) for p in self.root.iterdir())

    def recover(self) -> None:
        """Finish the commits a crash interrupted between their two renames (one process, before listing)."""
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if self._aside(entry):
                    recover(self.root / entry.name[1 : -len(".old")])

    def verify(self, path: str | os.PathLike[str]) -> str | None:
        """None if ``path`` can be resumed from (every byte verifies against its manifest and it holds the
        ``required`` files; or, written before manifests, its files are there), else why not, in a phrase.
        Reads every file once."""
        path = Path(path)
        problem = folder_problem(path)
        if problem is not None:
            return problem
        missing = [name for name in self.required if not (path / name).is_file()]
        return f"{missing[0]} is missing (it is not a checkpoint the Trainer wrote)" if missing else None

    def find_resumable(self, *, recover_first: bool = True, warn: bool = True) -> Resumable:
        """THE listing for a resume: finish interrupted commits (``recover_first=False`` on processes other
        than the main one, which does it), then the newest numbered folder :meth:`verify` passes. Logs a
        warning naming each newer one skipped and why (``warn=False``: the caller says it). Reads every file
        of the folders it checks."""
        if recover_first:
            self.recover()
        result = Resumable(None)
        for path in reversed(self.numbered()):  # complete or not: verify says why one is skipped
            problem = self.verify(path)
            if problem is None:
                result.checkpoint = path
                break
            result.skipped.append((path, problem))
        if result.skipped and warn:
            logger.warning("%s", result.describe_skipped())
        return result

    def resolve_resume(
        self, resume: bool | str | os.PathLike[str] | None, *, recover_first: bool = True
    ) -> Path | None:
        """What ``train(resume_from_checkpoint=resume)`` resumes from: ``None``/``False``: nothing (start fresh).
        ``True``: :meth:`find_resumable`'s folder (ValueError if none passes). A path: that folder, which must
        look complete (CheckpointError saying which file is wrong; loading then verifies every byte)."""
        if resume is None or resume is False:
            return None
        if resume is True:
            found = self.find_resumable(recover_first=recover_first)
            if found.checkpoint is None:
                why = f" ({found.describe_skipped()})" if found.skipped else ""
                raise ValueError(  # HF's words first: scripts and HF's tests match them
                    f"No valid checkpoint found in output directory ({self.root}): train(resume_from_checkpoint="
                    f"True) found no complete {self.prefix}N folder{why}; train without resume_from_checkpoint "
                    "to start fresh"
                )
            return found.checkpoint
        path = Path(resume)
        if recover_first:
            recover(path)
        if not path.is_dir():
            raise ValueError(f"Can't find a valid checkpoint at {path}: no such folder (resume_from_checkpoint=...)")
        # the cheap check here (sizes); the load reads and verifies every byte (no third read of the folder)
        problem = None if self.is_complete(path) else (self.verify(path) or "it lacks the trainer's files")
        if problem is not None:
            raise CheckpointError(
                f"Can't find a valid checkpoint at {path}: the folder is not a complete checkpoint ({problem}); "
                "use train(resume_from_checkpoint=True) for the newest one that is"
            )
        return path

    def prune(self, keep: int | None, protect: str | os.PathLike[str] | None = None, ended: bool = False) -> list[Path]:
        """The one keep-k policy: delete the oldest complete folders until ``keep`` are left (None keeps all),
        never ``protect`` (it counts among the ``keep``, as HF's best checkpoint does; HF's rule: with
        ``keep=1`` and a protected folder that is not the newest, both stay while the run may resume, and the
        newest goes once it has ``ended``). Call only after the newest folder is committed (the manager runs it
        on its writer thread). Returns what was deleted."""
        if keep is None:
            return []
        found = self.complete()
        protected = Path(protect).resolve() if protect is not None else None
        if keep == 1 and protected is not None and found and found[-1].resolve() != protected and not ended:
            keep = 2
        deletable = [p for p in found if p.resolve() != protected]
        removed = []
        for path in deletable[: max(len(found) - keep, 0)]:
            doomed = path.with_name(f".{path.name}{_DELETING}")
            os.rename(path, doomed)  # out of the numbered namespace first: a kill mid-delete leaves no fake
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(path)
        for stale in self.root.glob(f".{self.prefix}*{_DELETING}"):  # a delete a kill interrupted
            shutil.rmtree(stale, ignore_errors=True)
        return removed

    def _aside(self, path: Path) -> bool:
        name = path.name
        return name.startswith(f".{self.prefix}") and name.endswith(".old") and self.number_of(name[1:-4]) is not None


@dataclass
class Resumable:
    """What :meth:`NumberedFolders.find_resumable` found: the folder to resume from (None: none passes) and
    the newer ones it skipped, each with the reason."""

    checkpoint: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def describe_skipped(self) -> str:
        """One line: "skipped checkpoint-8 (model.safetensors does not match ...); resuming from checkpoint-4"."""
        parts = "; ".join(f"{p.name}: {why}" for p, why in self.skipped)
        then = f"resuming from {self.checkpoint.name}" if self.checkpoint else "no checkpoint is left to resume from"
        return f"skipped damaged or incomplete checkpoints ({parts}); {then}"


def trainer_folders(output_dir: str | os.PathLike[str]) -> NumberedFolders:
    """The Trainer's ``<output_dir>/checkpoint-<step>`` folders: complete when they hold the Trainer's files.
    The Trainer, ``mixprec train --resume`` and the watch's capsules all count through this one naming."""
    return NumberedFolders(
        output_dir, TRAINER_PREFIX, required=TRAINER_REQUIRED, legacy=(*TRAINER_REQUIRED, "rng_state_0.pt")
    )


def automatic_folders(project_dir: str | os.PathLike[str]) -> NumberedFolders:
    """The Accelerator's automatic ``<project_dir>/checkpoints/checkpoint_<n>`` folders (accelerate's naming)."""
    return NumberedFolders(
        Path(project_dir) / AUTOMATIC_DIR, AUTOMATIC_PREFIX, required=(META,), legacy=(META, "rng_state_0.pt")
    )
