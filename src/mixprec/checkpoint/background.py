"""One save at a time, written by a background thread while training goes on.

``Accelerator.save_state(..., async_save=True)`` stages what must not change (the model and optimizer
tensors, copied into host buffers: :mod:`mixprec.checkpoint.staging`) and hands the rest of the save to
:class:`BackgroundWriter`: writing the big files, hashing them into the manifest, and the commit (rename into
place). The folder's guarantees are those of a synchronous save (:mod:`mixprec.checkpoint.atomic`): until the
commit, the previous checkpoint is what a reader finds; a kill at any moment leaves no damaged ``checkpoint-N``.

One long-lived thread serves every save of a writer (issue 24: starting a thread per save was a fixed part of
the stall, and on a busy machine the new thread could hold the interpreter lock before ``start()`` returned).
It is not a daemon, and it is told to stop when the interpreter begins to exit, after the job in flight: an
interpreter that exits with a save in flight finishes it first, so a script's last save is never silently
dropped. A failed write is kept and raised by the next :meth:`wait` (the next save, a load, ``end_training``),
never lost.

A job may read live tensors after :meth:`submit` returns (the save's host copy, made on the writer so that it
overlaps the next forward and backward, which only read the weights and moments): until it calls
:meth:`release`, :meth:`fence` blocks, and every call that changes those tensors through mixprec (the prepared
optimizer's step, the step in backward, the LR scheduler's step) calls it first.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from mixprec.checkpoint.staging import HostStaging


class BackgroundWriter:
    """A single-slot writer: :meth:`submit` waits for the previous job, then hands the next to the writer's
    thread (started at the first job, reused after; it ends when the writer is collected or at exit)."""

    def __init__(self) -> None:
        self._worker = _Worker()
        # the thread holds the worker, never the writer: a dropped Accelerator frees its buffers and its thread
        weakref.finalize(self, self._worker.stop, False)
        self.staging = HostStaging()
        """The host buffers a job reads; the next save copies into them (its job has finished by then)."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # an Accelerator pickles (accelerate's scripts copy it); a lock and a thread do not: the copy gets an
        # idle writer of its own, with no buffers yet
        return (BackgroundWriter, ())

    def submit(self, job: Callable[[], object], name: str = "mixprec-save", *, reads_live: bool = False) -> None:
        """Run ``job()`` in the background, once the previous job has finished. Raises the previous job's
        error instead (the new job is then not started). Costs the caller a lock and a notify, no thread start
        after the first job. During the interpreter's exit (a save from an ``atexit`` handler) the job runs in
        the caller: no new thread can be joined then. ``reads_live``: :meth:`fence` blocks until the job calls
        :meth:`release` (or ends, whichever comes first)."""
        error = self.wait()
        if error is not None:
            raise error
        if not self._worker.put(job, name, reads_live):
            job()

    def fence(self) -> None:
        """Block until the job in flight no longer reads live tensors (see the module doc). No lock and no
        wait when it does not (the usual case: one attribute read)."""
        if self._worker.reading:
            self._worker.wait_released()

    def release(self) -> None:
        """Called by the job: it no longer reads live tensors; whoever waits in :meth:`fence` goes on."""
        self._worker.release()

    def wait(self) -> BaseException | None:
        """Block until the running job (if any) has finished; return its error (once), or None."""
        return self._worker.wait()


class _Worker:
    """The thread and the one-job slot it serves."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._job: Callable[[], object] | None = None  # the job in flight (set until it has finished)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False  # the writer is gone or the interpreter is exiting: end after the job
        # the job in flight still reads live tensors (set by the caller's own put(), so the caller never misses
        # it; cleared under the lock, so a caller that saw it set waits on the condition)
        self.reading = False

    def put(self, job: Callable[[], object], name: str, reads_live: bool = False) -> bool:
        """Hand ``job`` to the thread (started if need be); False when no thread can run it (exiting)."""
        with self._cond:
            if self._thread is None and not self._stopping:
                self._start(name)
            if self._thread is None:
                return False
            self._job = job
            self.reading = reads_live
            self._cond.notify_all()
            return True

    def wait_released(self) -> None:
        with self._cond:
            while self.reading:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self.reading = False
            self._cond.notify_all()

    def wait(self) -> BaseException | None:
        with self._cond:
            while self._job is not None:
                self._cond.wait()
            error, self._error = self._error, None
        return error

    def stop(self, join: bool = True) -> None:
        """End the thread once the job in flight (if any) has completed; ``join``: wait for that."""
        with self._cond:
            self._stopping = True
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if join and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start(self, name: str) -> None:
        try:
            # threading's hook that runs before it joins the non-daemon threads at exit (concurrent.futures'
            # workers stop the same way): without it, a thread waiting for jobs would keep the interpreter
            # from ever exiting; with it, the save in flight completes first
            threading._register_atexit(_stop_at_exit, weakref.ref(self))  # type: ignore[attr-defined]
        except RuntimeError:  # "can't register atexit after shutdown": the interpreter is already exiting
            self._stopping = True
            return
        self._thread = threading.Thread(target=self._serve, name=name, daemon=False)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stopping:
                    self._cond.wait()
                job = self._job
            if job is None:  # stopping, nothing in flight
                return
            error: BaseException | None = None
            try:
                job()
            except BaseException as err:  # kept for the caller: a background thread has no one to raise to
                error = err
            job = None  # what it wrote (small states, the copy's containers) is not kept while idle
            with self._cond:
                self._job, self._error, self.reading = None, error, False
                self._cond.notify_all()


def _stop_at_exit(ref: weakref.ref[_Worker]) -> None:
    worker = ref()
    if worker is not None:
        worker.stop()
