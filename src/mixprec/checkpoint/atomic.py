"""Atomic folders: a checkpoint on disk is either the previous one or the complete new one, never a mix.

The protocol (one writer per target folder):

1. :func:`begin` makes a fresh temporary folder ``.<name>.tmp-<tag>`` beside the target (the same
   filesystem, so the final rename is atomic) and removes temporary folders left by earlier crashed saves.
2. The caller writes its files into it. Every writer in :mod:`mixprec.checkpoint.formats` writes each file
   atomically and fsyncs it.
3. :func:`commit` fsyncs every file and folder, then renames the target aside to ``.<name>.old``, renames
   the temporary folder into place, fsyncs the parent and deletes the old folder.

POSIX cannot atomically replace a non-empty folder, hence the two renames. A crash between them leaves no
target but a complete ``.<name>.old``; :func:`recover` (called by :func:`begin` and by loaders) renames it
back, so a reader always finds the old state or the new one. A crash at any other point leaves the target
as it was, plus temporary litter that the next :func:`begin` removes.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


def begin(target: str | os.PathLike[str], *, tag: str | None = None) -> Path:
    """Create and return the temporary folder a save of ``target`` writes into.

    ``tag`` names it (``.<name>.tmp-<tag>``); by default a unique one. Processes that write into the same
    folder (one per rank) pass the same tag so they agree on its path without communicating strings.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    for stale in glob.glob(glob.escape(str(_tmp_prefix(target))) + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = temp_path(target, tag or f"{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def temp_path(target: str | os.PathLike[str], tag: str) -> Path:
    """The temporary folder :func:`begin` creates for ``target`` with ``tag`` (for processes that write
    into a folder another process began)."""
    return Path(f"{_tmp_prefix(Path(target))}{tag}")


def commit(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Make the finished temporary folder ``tmp`` the new ``target`` (see the module docstring)."""
    tmp, target = Path(tmp), Path(target)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"cannot save a checkpoint folder at {target}: a file of that name exists")
    fsync_tree(tmp)
    old = _old_path(target)
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)
    return target


def abort(tmp: str | os.PathLike[str]) -> None:
    """Throw away an unfinished temporary folder; the target is untouched."""
    shutil.rmtree(tmp, ignore_errors=True)


def recover(target: str | os.PathLike[str]) -> None:
    """Finish what a crash between :func:`commit`'s two renames left: restore or delete ``.<name>.old``."""
    target = Path(target)
    old = _old_path(target)
    if not old.exists():
        return
    if target.exists():  # the new folder made it into place; the old one is garbage
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(old, target)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str], *, tag: str | None = None) -> Iterator[Path]:
    """Write a folder atomically::

        with atomic_dir("ckpt/checkpoint-100") as tmp:
            save_tensors(model.state_dict(), tmp / "model.safetensors")
            save_json(state, tmp / "trainer_state.json")

    On a clean exit the folder replaces ``target``; on an exception (or a crash) ``target`` is unchanged.
    """
    tmp = begin(target, tag=tag)
    try:
        yield tmp
    except BaseException:
        abort(tmp)
        raise
    commit(tmp, target)


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)``, fsync the file, then rename it to ``path`` (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder so renames inside it are durable (a no-op where the OS cannot open folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and folder under ``root`` (files written by callers that did not fsync them)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


def _tmp_prefix(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-")


def _old_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")
