"""Atomic folders: a checkpoint on disk is either the previous one or the complete new one, never a mix.

The protocol (one writer per target folder):

1. :func:`begin` makes a fresh temporary folder ``.<name>.tmp-<pid>-<tag>`` beside the target (the same
   filesystem, so the final rename is atomic) and removes temporary folders left by earlier crashed saves:
   those whose process is no longer running. A live process's folder is never touched, so two writers can
   no longer delete each other's work in progress (issue 14, fault 1); one run per folder is
   :mod:`mixprec.checkpoint.lock`'s job.
2. The caller writes its files into it. Every writer in :mod:`mixprec.checkpoint.safe_files` writes each file
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
import errno
import glob
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path


def begin(target: str | os.PathLike[str], *, tag: str | None = None) -> Path:
    """Create and return the temporary folder a save of ``target`` writes into.

    ``tag`` names it (``.<name>.tmp-<tag>``); by default ``<pid>-<random>``, unique to this process and
    save. Processes that write into the same folder (one per rank) pass the same tag, starting with the
    main process's PID (so that a stale one is recognised), to agree on its path without sending strings.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    prefix = str(_tmp_prefix(target))
    for stale in glob.glob(glob.escape(prefix) + "*"):
        if not _owner_alive(stale[len(prefix) :]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = temp_path(target, tag or f"{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def _owner_alive(tag: str) -> bool:
    """Whether the process whose PID starts ``tag`` still runs here (a tag without one: a crashed save of an
    older mixprec, whose temporary folders all used one fixed name)."""
    head = tag.split("-", 1)[0]
    if not head.isdigit():
        return False
    pid = int(head)
    if pid == os.getpid():  # an earlier save of this process that failed to clean up (saves run one at a time)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


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


class DiskFullError(OSError):
    """No space was left on the device while writing a file (errno ENOSPC); what was there before is intact."""

    def __str__(self) -> str:  # the sentence alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


# The process's umask, read once (os.umask can only be read by setting it): files are given the mode a
# plain open() would give them. safetensors creates its files 0600 (issue 14, point 9), everything else 0644.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)``, fsync the file, then rename it to ``path`` (readers never see half a file).

    The file gets the usual mode (0666 less the umask) whatever ``write`` created it with. A write that runs
    out of disk space raises :class:`DiskFullError` naming ``path``; ``path`` is then as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, stat.S_IMODE(0o666 & ~_UMASK))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if _is_disk_full(err, path.parent):
            raise DiskFullError(errno.ENOSPC, f"no space left on the disk while writing {path}", str(path)) from None
        raise
    fsync_dir(path.parent)
    return path


def _is_disk_full(err: BaseException, folder: Path) -> bool:
    """ENOSPC, or a writer that hides it: torch.save reports a full disk as a RuntimeError ("enforce fail
    ... unexpected pos"), so for any other error the free space decides (under 1 MiB left: full)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(err, RuntimeError):
        return False
    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


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
        with contextlib.suppress(OSError):
            os.fsync(fd)
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


def unfinished_target(path: str | os.PathLike[str]) -> str | None:
    """The name of the target whose unfinished temporary folder (``.<name>.tmp-<tag>``, made by :func:`begin`)
    is ``path`` or holds it, None otherwise: which folder a failed write was for (a full disk, say)."""
    for part in reversed(Path(path).parts):
        if part.startswith(".") and ".tmp-" in part:
            return part[1:].rpartition(".tmp-")[0] or None
    return None


def _old_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")
