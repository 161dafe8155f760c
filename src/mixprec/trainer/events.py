"""Where a run reports: its callbacks, ``state.log_history``, metrics.jsonl and the progress bar.

One object, :class:`RunEvents`, owns them and the state and control the callbacks see, behind four calls the
Trainer and its helpers (loop, checkpointing, summary, diagnosis) share: ``fire`` (a callback event),
``log`` (a log_history entry, written to metrics.jsonl and sent to every logger), ``record`` (a metrics.jsonl
record outside log_history) and ``close_progress``. No helper reaches for a logger of its own.

The callback list is HF's: the default flow, the ``report_to`` loggers, the progress bar (or, with
``disable_tqdm``, the printer) and the user's callbacks. metrics.jsonl is the run's own record (resume
truncates it, the plots and the summary read it), so it is written here, not by a callback a user could
remove.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.trainer.callbacks import CallbackHandler, DefaultFlowCallback, TrainerCallback, TrainerControl
from mixprec.trainer.logging import JsonlLogger
from mixprec.trainer.progress import PrinterCallback, ProgressCallback
from mixprec.trainer.state import TrainerState
from mixprec.trainer.watching import WatchCallback

if TYPE_CHECKING:
    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.trainer.args import TrainingArguments


class RunEvents:
    """The callbacks and loggers of one Trainer, with the ``state`` and ``control`` they are passed.

    ``control`` may be replaced by any event (a callback that returns a TrainerControl); read it from here
    after an event, never keep an old one. ``state`` is replaced only by :meth:`new_run`."""

    def __init__(
        self,
        args: TrainingArguments,
        accelerator: Accelerator,
        reporters: list[TrainerCallback],
        callbacks: list[TrainerCallback | type[TrainerCallback]],
    ) -> None:
        self.args = args
        self.state = self._fresh_state(accelerator)
        self.control = TrainerControl()
        self.handler = CallbackHandler([DefaultFlowCallback])
        self.metrics: JsonlLogger | None = None
        """metrics.jsonl's writer; on the main process only (None elsewhere)."""
        self.progress: ProgressCallback | None = None
        if accelerator.is_main_process:
            self.metrics = JsonlLogger(args.output_dir)
            for reporter in reporters:
                self.handler.add_callback(reporter)
            if args.disable_tqdm:
                self.handler.add_callback(PrinterCallback)
            else:
                self.progress = ProgressCallback()
                self.handler.add_callback(self.progress)
        if accelerator.watch is not None:
            self.handler.add_callback(
                WatchCallback(accelerator.watch, self.log, self.record, accelerator.is_main_process)
            )
        for cb in callbacks:
            self.handler.add_callback(cb)

    @staticmethod
    def _fresh_state(accelerator: Accelerator) -> TrainerState:
        return TrainerState(
            is_local_process_zero=accelerator.is_local_main_process,
            is_world_process_zero=accelerator.is_main_process,
        )

    def new_run(self, accelerator: Accelerator) -> None:
        """A later ``train()`` (HF): a fresh state and control."""
        self.state = self._fresh_state(accelerator)
        self.control = TrainerControl()

    def fire(self, name: str, **kwargs: Any) -> TrainerControl:
        """Run callback event ``name``; returns the (possibly replaced) control."""
        self.control = self.handler.call_event(name, self.args, self.state, self.control, **kwargs)
        return self.control

    def log(self, logs: dict[str, Any]) -> None:
        """Append ``logs`` (with epoch and step) to ``state.log_history`` and send it to the loggers."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        if self.metrics is not None:
            self.metrics.write({"step": self.state.global_step, "epoch": self.state.epoch, **logs})
        self.fire("on_log", logs=logs)

    def record(self, name: str, step: int, **fields: Any) -> None:
        """A metrics.jsonl record outside log_history (skipped steps, loss-scale changes); main process only."""
        if self.metrics is not None:
            self.metrics.event(name, step, **fields)

    def close_progress(self) -> None:
        """End the progress bar's line (before an error or the summary is printed)."""
        if self.progress is not None:
            self.progress.on_train_end(self.args, self.state, self.control)

    @property
    def metrics_path(self) -> Path | None:
        """metrics.jsonl, on the process that writes it."""
        return self.metrics.path if self.metrics is not None else None

    def forget_records_after(self, step: int) -> None:
        """After a resume from checkpoint-``step``: drop the records a killed run wrote past it."""
        if self.metrics is not None:
            self.metrics.truncate_after(step)
