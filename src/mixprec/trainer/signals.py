"""SIGTERM (a preempted job) or a first Ctrl-C (SIGINT): finish the step in flight, save a checkpoint, raise
:class:`TrainingInterrupted`. A second Ctrl-C stops at once, as Ctrl-C does elsewhere (KeyboardInterrupt).

The handler only sets a flag; the loop reads it at each step boundary, so a checkpoint is never taken in
the middle of a step. Under several processes the flag is agreed on with one tiny all-reduce per step (a
MAX over processes), so every process stops at the same step even when the signal reaches them at
different moments; with one process it costs nothing. The previous handler is restored when training ends.

``train()`` then raises :class:`TrainingInterrupted`; it never ends the process itself (a library must not
end its caller's process). Code after ``train()`` expects a finished run, so the stop is an exception
rather than a normal return; HF's Trainer has no handler (the signal's default action kills the process).
``mixprec train`` turns it into exit status 128 + the signal (143 for SIGTERM), which is what batch
schedulers read as "stopped, not finished"; a script does the same with::

    try:
        trainer.train()
    except TrainingInterrupted as stop:
        sys.exit(stop.exit_status)
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any


class TrainingInterrupted(Exception):
    """``Trainer.train()`` was stopped by ``signum`` (15: SIGTERM) at ``step``, after saving ``checkpoint``
    (None if no step had completed yet). ``resume_command`` says how to continue the run."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, resume_command: str) -> None:
        self.signum, self.step, self.checkpoint, self.resume_command = signum, step, checkpoint, resume_command
        super().__init__(f"stopped by signal {signum} at step {step}; resume with {resume_command}")

    @property
    def exit_status(self) -> int:
        """The process exit status that reports this stop: 128 + the signal (143 for SIGTERM), as a shell
        reports a process the signal ended."""
        return 128 + self.signum


class GracefulStop:
    """Context manager that turns SIGTERM and a first SIGINT into a request to stop at the next step boundary."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.requested = False
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.received = signum
        if signum == signal.SIGINT:  # the next Ctrl-C is the previous handler's again: it stops at once
            signal.signal(signum, self._previous.pop(signum, signal.default_int_handler))
            print(
                "mixprec: Ctrl-C: saving a checkpoint after this step, then stopping (Ctrl-C again: at once)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> GracefulStop:
        # signal.signal only works in the main thread; elsewhere (a notebook worker thread) we do without.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, reduce_max: Any = None) -> bool:
        """Whether to stop now. ``reduce_max(bool) -> bool`` makes processes agree (None: one process)."""
        return bool(reduce_max(self.requested)) if reduce_max is not None else self.requested
