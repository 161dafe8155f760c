"""One run per folder: an OS file lock held for the life of the run.

Two runs writing into one output folder replace or interleave each other's checkpoints and metrics (issue
14, fault 1). :func:`lock_folder` takes an exclusive ``fcntl.flock`` on ``<folder>/.mixprec.lock`` and
writes the holder's PID into it; a second process asking for the same folder gets
:class:`FolderInUseError` naming the folder and that PID. The OS releases the lock when the process ends
however it ends (SIGKILL, out of memory), so a stale lock never needs cleaning up: a leftover file holding
a dead PID is simply locked again.

The lock is re-entrant within a process (the command line takes it, then its Trainer takes it again):
flock locks belong to an open file description, so a second ``open`` in the same process would otherwise
refuse its own owner. Where ``fcntl`` does not exist (Windows) the lock is a no-op.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; one run per folder is then the user's care
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".mixprec.lock"

_held: dict[str, list[Any]] = {}  # real path of the folder -> [open file, count of holders in this process]
_guard = threading.Lock()


class FolderInUseError(RuntimeError):
    """Another running process holds the folder's lock."""


class FolderLock:
    """A held lock on one folder; :meth:`release` (or leaving the ``with`` block) lets it go."""

    def __init__(self, key: str) -> None:
        self._key: str | None = key

    def release(self) -> None:
        """Let the lock go (once; later calls do nothing). The last holder in the process closes the file."""
        key, self._key = self._key, None
        if key is None:
            return
        with _guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                entry[0].close()  # closing the file releases the flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_folder(folder: str | os.PathLike[str], *, what: str = "output folder") -> FolderLock:
    """Create ``folder`` if needed and lock it for this process; raises :class:`FolderInUseError` (the folder
    and the holder's PID) when another process holds it. ``what`` names the folder in that message (the
    flag or argument the user set). Costs one open and one flock; never blocks."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(path)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return FolderLock(key)
        if fcntl is None:  # pragma: no cover
            return FolderLock(key)
        file = open(path / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's life
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise FolderInUseError(
                f"{what} {path} is in use by another run (process {holder}); wait for it to end, stop it, or "
                "choose another folder"
            ) from None
        try:
            file.seek(0)
            file.truncate()
            file.write(f"{os.getpid()}\n")
            file.flush()
        except OSError:
            file.close()
            raise
        _held[key] = [file, 1]
        return FolderLock(key)
