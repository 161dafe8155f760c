"""The main process's verdict, told to every process before any process group exists.

Some checks run on the main process alone, before the Accelerator joins the process group (``mixprec train``
locking its run folder: an OS file lock, which one process holds). Refused, the main process exits with a
one-line error, and the others would wait in a process group that never forms until the collective timeout
(issue 24: "the folder lock under torchrun reports to every rank").

:func:`main_decides` runs the check on the main process and writes its outcome (empty: success; else the
error's type and message) into the launch's key-value store (:func:`mixprec.strategies.peers.open_early_store`).
The other processes wait for that key and raise the same error; on a failure the main process waits until
they have read it before it exits, since the launcher stops the others as soon as one process ends. Cost:
one store round trip per process, no process group. Without a store (one process, no MASTER_ADDR/PORT)
the check runs on the main process only.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from mixprec.strategies.peers import open_early_store

T = TypeVar("T")

_KEY = "mixprec/verdict/"
TOLD_WAIT_S = 60.0
"""Longest the main process waits, after a refusal, for the others to read it (they may still be loading)."""
_SEP = "\x1f"  # between the error's type name and its message (a character no message holds)


class MainProcessRefused(RuntimeError):
    """The main process's check failed with an error of a type this process cannot rebuild."""


def main_decides(
    name: str,
    check: Callable[[], T],
    errors: tuple[type[Exception], ...],
    *,
    timeout_s: float = 300.0,
    environ: Mapping[str, str] = os.environ,
) -> T | None:
    """``check()`` on the main process (rank 0), its outcome told to every process of the launch.

    Returns ``check()``'s result on the main process and None elsewhere. When ``check`` raises one of
    ``errors`` (the user-facing ones, such as ``FolderInUseError``), every process raises an error of that
    type with the main process's message; other exceptions are told as :class:`MainProcessRefused`.
    ``name`` names the check (one store key per name and launch attempt)."""
    rank = int(environ.get("RANK", "0"))
    store = open_early_store(datetime.timedelta(seconds=timeout_s), environ)
    key = _KEY + name
    if rank == 0:
        try:
            result = check()
        except BaseException as err:
            if store is not None:
                store.set(key, f"{type(err).__name__}{_SEP}{err}")
                _wait_until_told(store, key, int(environ["WORLD_SIZE"]) - 1, min(timeout_s, TOLD_WAIT_S))
            raise
        if store is not None:
            store.set(key, "")
        return result
    if store is None:
        return None
    told = store.get(key).decode("utf-8")  # waits until the main process has decided
    if not told:
        return None
    store.add(key + "/told", 1)
    kind, _, message = told.partition(_SEP)
    error_type = next((e for e in _with_subclasses(errors) if e.__name__ == kind), None)
    if error_type is None:
        raise MainProcessRefused(f"the main process failed: {kind}: {message}")
    raise error_type(f"{message} (told by the main process)")


def _wait_until_told(store, key: str, others: int, timeout_s: float) -> None:  # noqa: ANN001 - a torch Store
    """Wait (polling every 50 ms, at most ``timeout_s``) until ``others`` processes have read the verdict."""
    deadline = time.monotonic() + timeout_s
    while store.add(key + "/told", 0) < others and time.monotonic() < deadline:
        time.sleep(0.05)


def _with_subclasses(errors: tuple[type[Exception], ...]) -> list[type[Exception]]:
    """``errors`` and their direct subclasses (OSError: PermissionError, FileExistsError...)."""
    return [sub for error in errors for sub in (error, *error.__subclasses__())]
