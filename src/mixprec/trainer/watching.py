"""The precision watch in the Trainer: its records into metrics.jsonl and TensorBoard, its summary and plot.

The watch itself (:mod:`mixprec.watch`) is built by the Accelerator from ``TrainingArguments(precision_watch=
...)`` and follows the steps on its own; this callback only tells it when an optimizer step is over (so a
skipped step is attributed while its gradients are still there) and carries what it found to the run's logs:
each sample as one log entry of ``watch/<layer>/<field>`` scalars (metrics.jsonl, and TensorBoard when
``report_to`` has it), warnings, skip attributions and fallbacks as metrics.jsonl events, and at the end a
"precision_watch" section in train_summary.json and ``precision_headroom.png`` in output_dir.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.trainer.callbacks import TrainerCallback
from mixprec.trainer.logging import METRICS_FILE, read_metrics
from mixprec.trainer.summary import write_summary
from mixprec.watch import PrecisionWatch


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
        self.watch.close()
        if summary is None:
            return
        summary["precision_watch"] = self.watch.summary()
        if not self._is_main:
            return
        write_summary(summary, args.output_dir)  # again, now with the watch's section
        metrics = Path(args.output_dir) / METRICS_FILE
        if args.save_plots and metrics.exists():
            from mixprec.watch.plot import plot_headroom, series_from_log

            plot_headroom(series_from_log(read_metrics(metrics)), Path(args.output_dir), self.watch.fmt.name,
                          self.watch.marks())  # fmt: skip
        print("\n".join(self.watch.summary_lines()), file=sys.stderr, flush=True)
