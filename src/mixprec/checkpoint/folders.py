"""Numbered checkpoint folders, one owner (after torchtitan's ``CheckpointManager``): which exist, which are
complete, which is the newest, what a crash left half-committed, and which to delete.

Both namings of mixprec go through :class:`NumberedFolders`, so they cannot drift apart: the Trainer's
``<output_dir>/checkpoint-<step>`` and the Accelerator's automatic ``<project_dir>/checkpoints/checkpoint_<n>``
(accelerate's name). The rules are the same for both:

- listing skips a folder that is not complete, by a cheap check that reads no file's bytes (every file its
  manifest lists is there with the listed size; a folder written before manifests needs its ``legacy`` files);
- :meth:`NumberedFolders.recover` finishes commits a crash interrupted between the two renames of
  :func:`mixprec.checkpoint.atomic.commit`;
- :meth:`NumberedFolders.prune` is called after the new folder is committed (a crash before it leaves one
  folder too many, never one too few), keeps ``keep`` complete folders (the newest, and a protected one), and
  renames each doomed folder out of the numbered namespace before deleting it, so a kill mid-delete never
  leaves a damaged folder that looks like a checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from mixprec.checkpoint.atomic import recover
from mixprec.checkpoint.manifest import read_manifest

_DELETING = ".deleting"


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
    if not all(name in files for name in required):
        return False
    for rel, entry in files.items():
        try:
            if (path / rel).stat().st_size != entry.get("size"):
                return False
        except (OSError, AttributeError):
            return False
    return True


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
        return self.root / f"{self.prefix}{number}"

    def is_complete(self, path: str | os.PathLike[str]) -> bool:
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

    def prune(self, keep: int | None, protect: str | os.PathLike[str] | None = None) -> list[Path]:
        """Delete the oldest complete folders until ``keep`` are left (None keeps all), never ``protect`` (it
        counts among the ``keep``, as HF's best checkpoint does). Call only after the newest folder is
        committed. Returns what was deleted."""
        if keep is None:
            return []
        found = self.complete()
        protected = Path(protect).resolve() if protect is not None else None
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
