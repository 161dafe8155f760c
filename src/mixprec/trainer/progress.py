"""What the console shows: the progress bar (steps, loss, learning rate, loss scale and samples or tokens per
second) or, with ``disable_tqdm``, each log entry printed as HF's PrinterCallback does.

The loss shown is the mean since the previous refresh. Reading it is a host sync, so the bar refreshes its
numbers at most once a second (one sync per second, whatever the step rate), and never on the other steps.
"""

from __future__ import annotations

import time
from typing import Any

from mixprec.trainer.callbacks import TrainerCallback


class ProgressCallback(TrainerCallback):
    """A tqdm bar over optimizer steps (main process only), with a line per evaluation."""

    refresh_seconds = 1.0

    def __init__(self) -> None:
        self.bar: Any = None
        self._last_refresh = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
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
