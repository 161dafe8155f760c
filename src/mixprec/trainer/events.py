"""Where a run reports: its callbacks, ``state.log_history``, metrics.jsonl, the progress bar and the watch.

One object, :class:`RunEvents`, owns them and the state and control the callbacks see, behind four calls the
Trainer and its helpers (loop, checkpointing, summary, diagnosis) share: ``fire`` (a callback event),
``log`` (a log_history entry, written to metrics.jsonl and sent to every logger), ``record`` (a metrics.jsonl
record outside log_history) and ``close_progress``. No helper reaches for a logger of its own.

The callback list is HF's: the default flow, the ``report_to`` loggers, the progress bar (or, with
``disable_tqdm``, the printer), the precision watch's callback and the user's callbacks. metrics.jsonl is the
run's own record (resume truncates it, the plots and the summary read it), so it is written here, not by a
callback a user could remove.

Nothing here knows the run's end-of-run reporting (:mod:`mixprec.trainer.summary`): that module takes the
:class:`~mixprec.trainer.context.RunContext` holding these events and calls down into them, never the reverse.

**The console** (:class:`ProgressCallback`, :class:`PrinterCallback`): a progress bar (steps, loss, learning rate,
loss scale, samples or tokens per second) or, with ``disable_tqdm``, each log entry printed as HF's PrinterCallback
does. The loss shown is the mean since the previous refresh; reading it is a host sync, so the bar refreshes its
numbers at most once a second. When stderr is not a terminal, a redrawn bar is a run of carriage returns on one
line that any other message gets glued to (issue 29), so there the progress is a plain line every tenth of the run
(:class:`LineProgress`).

**The precision watch** (:class:`WatchCallback`): the watch (:mod:`mixprec.watch`, built by the Accelerator from
``precision_watch``) follows the steps on its own; this callback tells it when an optimizer step is over (so a
skipped step is attributed while its gradients are still there) and carries what it found to the run's logs:
samples as ``watch/<layer>/<field>`` log entries, warnings, skip attributions and fallbacks as metrics.jsonl
events, and at the end a "precision_watch" section of the summary and ``precision_headroom.png``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    restore_callback_states,
)
from mixprec.trainer.logging import METRICS_FILE, JsonlLogger, read_metrics
from mixprec.trainer.state import TrainerState
from mixprec.watch.plot import plot_headroom, series_from_log

if TYPE_CHECKING:
    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.trainer.args import TrainingArguments
    from mixprec.watch import PrecisionWatch


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
        self.new_run(accelerator)
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

    def new_run(self, accelerator: Accelerator) -> None:
        """A fresh state and control: the Trainer's first, and a later ``train()``'s (HF)."""
        is_local, is_main = accelerator.is_local_main_process, accelerator.is_main_process
        self.state = TrainerState(is_local_process_zero=is_local, is_world_process_zero=is_main)
        self.control = TrainerControl()

    def restore_callback_states(self) -> None:
        """After a resume, with ``restore_callback_states_from_checkpoint``: rebuild the stateful callbacks and
        the control from ``state.stateful_callbacks`` (HF's ``Trainer._load_callback_state``)."""
        if self.args.restore_callback_states_from_checkpoint:
            self.control = restore_callback_states(self.handler, self.control, self.state.stateful_callbacks)

    def fire(self, name: str, **kwargs: Any) -> TrainerControl:
        """Run callback event ``name``; returns the control, which a callback may have replaced."""
        self.control = self.handler.call_event(name, self.args, self.state, self.control, **kwargs)
        return self.control

    def log(self, logs: dict[str, Any]) -> None:
        """Append ``logs`` (with epoch and step) to ``state.log_history`` and send it to the loggers."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        if self.args.include_num_input_tokens_seen != "no":  # in every entry, as HF's (evaluations included)
            logs = {**logs, "num_input_tokens_seen": self.state.num_input_tokens_seen}
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


# -- the console ----------------------------------------------------------------------------------------


class LineProgress:
    """tqdm's part the callback uses (update, set_postfix, write, close), as whole lines on stderr: one at
    each tenth of ``total`` and one at the end."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train") -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.postfix: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._next = self._mark_after(initial)

    def _mark_after(self, n: int) -> int:
        tenth = max(1, self.total // 10)
        return (n // tenth + 1) * tenth

    def _line(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        return f"{self.desc}: {self.n}/{self.total} steps, {time.perf_counter() - self._start:.1f}s" + (
            f", {extra}" if extra else ""
        )

    def update(self, k: int) -> None:
        self.n += k
        if self.n >= self._next and self.n < self.total:
            self.write(self._line())
            self._next = self._mark_after(self.n)

    def set_postfix(self, postfix: dict[str, Any], refresh: bool = False) -> None:
        self.postfix = dict(postfix)

    @staticmethod
    def write(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.write(self._line())


class ProgressCallback(TrainerCallback):
    """A tqdm bar over optimizer steps (main process only), with a line per evaluation."""

    refresh_seconds = 1.0

    def __init__(self) -> None:
        self.bar: Any = None
        self._meter: Any = None  # the run's StepMeter, for the last line
        self._shown: dict[str, str] = {}
        self._last_refresh = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if not sys.stderr.isatty():
            self.bar = LineProgress(state.max_steps, state.global_step)
        else:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=state.max_steps, initial=state.global_step, desc="train", unit="step", dynamic_ncols=True
            )
        self._last_refresh = time.perf_counter()

    def on_step_end(self, args, state, control, meter=None, **kwargs):
        if self.bar is None:
            return
        self.bar.update(state.global_step - self.bar.n)
        self._meter = meter
        now = time.perf_counter()
        if meter is not None and now - self._last_refresh >= self.refresh_seconds:
            self._last_refresh = now
            self._show(meter.postfix())

    def _show(self, shown: dict[str, str]) -> None:
        self._shown = shown  # kept here: tqdm keeps its postfix as one formatted string
        self.bar.set_postfix(shown, refresh=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # a logged loss and lr are the run's values at this step: shown at once (no sync, they are host
        # floats), so the last line matches metrics.jsonl instead of a refresh up to a second old (issue 34)
        if self.bar is not None and logs and "loss" in logs:
            shown = dict(self._shown, loss=f"{logs['loss']:.4f}")
            if "learning_rate" in logs:
                shown["lr"] = f"{logs['learning_rate']:.2e}"
            self._show(shown)
            self._last_refresh = time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.bar is not None and metrics:
            shown = {
                k: v for k, v in metrics.items() if isinstance(v, float) and not k.endswith(("_runtime", "_second"))
            }
            self.bar.write(f"step {state.global_step}: " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            if self._meter is not None:  # the end's lr, loss scale and rate; the loss of steps not logged yet
                shown = self._meter.postfix()
                if "loss" not in shown and "loss" in self._shown:  # every step logged: the last logged loss
                    shown = {"loss": self._shown["loss"], **shown}
                self._show(shown)
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """Prints each log entry (main process), in place of the bar when ``disable_tqdm=True`` (HF's)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs is not None:
            shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
            print(shown, flush=True)


# -- the precision watch --------------------------------------------------------------------------------


class WatchCallback(TrainerCallback):
    """Wires a :class:`~mixprec.watch.PrecisionWatch` to the Trainer's step events and logs.

    ``log`` is ``RunEvents.log`` (log_history, metrics.jsonl, TensorBoard), ``record`` is ``RunEvents.record``
    (metrics.jsonl events, main process only); the watch's records wait for ``on_step_end``, where the
    state's global_step is the step they describe.
    """

    def __init__(
        self,
        watch: PrecisionWatch,
        log: Callable[[dict[str, Any]], None],
        record: Callable[..., None],
        is_main: bool,
    ) -> None:
        self.watch = watch
        self._log, self._record, self._is_main = log, record, is_main
        self._pending: list[tuple[str, int, dict[str, Any]]] = []
        watch.add_sink(lambda kind, step, fields: self._pending.append((kind, step, fields)))

    def on_train_begin(self, args, state, control, **kwargs):
        if self._is_main:  # capsules of bad steps go to <output_dir>/capsules (one writer)
            self.watch.set_run_folder(args.output_dir)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.watch.sync(optimizer)  # before zero_grad: a skip the replay cannot trace is read off .grad

    def on_step_end(self, args, state, control, **kwargs):
        pending, self._pending = self._pending, []
        for kind, step, fields in pending:
            if kind == "watch_sample":
                self._log(fields)
            else:
                self._record(kind, step, **{k: v for k, v in fields.items() if k != "step"})

    def on_train_end(self, args, state, control, summary=None, **kwargs):
        """Close the watch and add its section to ``summary`` (the summary writes the file again after this
        event, with the section); on the main process, plot the headroom and print the watch's lines."""
        self.watch.close()
        if summary is None:
            return
        summary["precision_watch"] = self.watch.summary()
        if not self._is_main:
            return
        metrics = Path(args.output_dir) / METRICS_FILE
        if args.save_plots and metrics.exists():
            plot_headroom(
                series_from_log(read_metrics(metrics)), Path(args.output_dir), self.watch.fmt.name, self.watch.marks()
            )
        print("\n".join(self.watch.summary_lines()), file=sys.stderr, flush=True)
