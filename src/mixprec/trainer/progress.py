"""What the console shows: the progress bar (steps, loss, learning rate, loss scale and samples or tokens per
second) or, with ``disable_tqdm``, each log entry printed as HF's PrinterCallback does.

The loss shown is the mean since the previous refresh. Reading it is a host sync, so the bar refreshes its
numbers at most once a second (one sync per second, whatever the step rate), and never on the other steps.

When stderr is not a terminal (a log file, a pipe, a batch job), a redrawn bar is a run of carriage returns
on one line that any other message gets glued to (issue 29: ``...0/300 [00:00<?, ?step/s]mixprec: bf16 on
cpu ...``); there the progress is a plain line every tenth of the run instead (:class:`LineProgress`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from mixprec.trainer.callbacks import TrainerCallback


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
        self._last_refresh = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if not sys.stderr.isatty():
            self.bar = LineProgress(state.max_steps, state.global_step)
            self._last_refresh = time.perf_counter()
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step", dynamic_ncols=True)
        self._last_refresh = time.perf_counter()

    def on_step_end(self, args, state, control, meter=None, **kwargs):
        if self.bar is None:
            return
        self.bar.update(state.global_step - self.bar.n)
        now = time.perf_counter()
        if meter is not None and now - self._last_refresh >= self.refresh_seconds:
            self._last_refresh = now
            self.bar.set_postfix(meter.postfix(), refresh=False)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.bar is not None and metrics:
            shown = {
                k: v for k, v in metrics.items() if isinstance(v, float) and not k.endswith(("_runtime", "_second"))
            }
            self.bar.write(f"step {state.global_step}: " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """Prints each log entry (main process), in place of the bar when ``disable_tqdm=True`` (HF's)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs is not None:
            shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
            print(shown, flush=True)
