"""One save at a time, written by a background thread while training goes on.

``Accelerator.save_state(..., async_save=True)`` stages what must not change (the model and optimizer
tensors, copied to host memory) and hands the rest of the save to :class:`BackgroundWriter`: writing the big
files, hashing them into the manifest, and the commit (rename into place). The folder's guarantees are
those of a synchronous save (:mod:`mixprec.checkpoint.atomic`): until the commit, the previous checkpoint
is what a reader finds; a kill at any moment leaves no damaged ``checkpoint-N``.

The thread is not a daemon: an interpreter that exits with a save in flight finishes it first (Python joins
non-daemon threads before shutting down), so a script's last save is never silently dropped. A failed write
is kept and raised by the next :meth:`wait` (the next save, a load, ``end_training``), never lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundWriter:
    """A single-slot writer: :meth:`submit` waits for the previous job, then starts the next on a new thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.staging: Any = None
        """The host copy the last job wrote, reused by the next save (the job has finished by then)."""

    @property
    def busy(self) -> bool:
        """Whether a job is still running (no wait)."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], object], name: str = "mixprec-save") -> None:
        """Run ``job()`` in the background, once the previous job has finished. Raises the previous job's
        error instead (the new job is then not started)."""
        error = self.wait()
        if error is not None:
            raise error

        def run() -> None:
            try:
                job()
            except BaseException as err:  # kept for the caller: a background thread has no one to raise to
                self._error = err

        self._thread = threading.Thread(target=run, name=name, daemon=False)
        self._thread.start()

    def wait(self) -> BaseException | None:
        """Block until the running job (if any) has finished; return its error (once), or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error
