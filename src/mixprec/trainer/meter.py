"""Running training metrics kept on the device, read only when someone looks.

The loss of every micro-batch is added to a device tensor (no sync). The logger reads the window's mean at
each logging step, the progress bar at most once a second; each read is one host sync. Sample and token
counts come from tensor shapes, which live on the host, so they never sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mixprec.trainer.phase_clock import PhaseClock


class StepMeter:
    """Loss since the last log, throughput since the last look, and totals for the summary."""

    def __init__(
        self,
        loss_scale: Callable[[], float],
        nan_inf_filter: bool = True,
        across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.across = across  # sums a tensor over the processes (several): the logged means are the run's, HF's
        self.learning_rate = 0.0  # the rate the last step ran with (the loop sets it): logged and shown, as HF's
        self._loss_scale = loss_scale
        # HF's logging_nan_inf_filter: the non-finite loss of a skipped step is left out of the logged means
        # (counted on the device, so still no sync), instead of turning every later mean into nan
        self.nan_inf_filter = nan_inf_filter
        self._window_sum: torch.Tensor | None = None
        self._window_finite: torch.Tensor | None = None
        self._window_count = 0
        self.total_loss = 0.0  # host sum of the windows already read
        self.total_count = 0
        # the totals a resumed run started from (its checkpoint's, open window included): the summary's mean is
        # over this run's steps, the logged means over the whole run's (as an uninterrupted run logs them)
        self._run_base = (0.0, 0)
        self.samples = 0
        self.tokens = 0
        self.filtered = 0  # non-finite micro-batch losses the filter left out of this run's means
        self.phases = PhaseClock()
        """Where the run's time goes, phase by phase (the loop laps it; the summary reads it)."""
        self.start()

    def start(self) -> None:
        """Start the clock (at the first step, not at construction: setup is not throughput)."""
        self.start_time = time.perf_counter()
        self.phases.start()
        self._rate_mark = (self.start_time, self.samples, self.tokens)

    def add(self, loss: torch.Tensor, samples: int, tokens: int) -> None:
        """Record one micro-batch. No host sync."""
        value = loss.detach().float()
        if self.nan_inf_filter:
            finite = torch.isfinite(value)
            value = torch.where(finite, value, torch.zeros_like(value))
            self._window_finite = finite.float() if self._window_finite is None else self._window_finite + finite
        self._window_sum = value if self._window_sum is None else self._window_sum + value
        self._window_count += 1
        self.samples += samples
        self.tokens += tokens

    def _window(self, everywhere: bool = False) -> tuple[float, int, int] | None:
        """(sum, count, added) of the window's losses, the non-finite ones left out of the count under the
        filter; ``everywhere``: summed over the processes (a collective). One sync."""
        if self._window_sum is None:
            return None
        total = self._window_sum.float()
        added = torch.full_like(total, self._window_count)
        finite = self._window_finite.float() if self._window_finite is not None else added
        window = torch.stack([total, finite, added])
        if everywhere and self.across is not None:
            window = self.across(window)
        total, count, added = window.tolist()
        return total, int(count), int(added)

    def _mean(self, total: float, count: int) -> float:
        if count:
            return total / count
        # every loss of the window was filtered out (inf/NaN): the run's mean so far, and 0.0 before any finite
        # loss (HF's arithmetic: its filter adds the window's running mean, which starts at 0); the log entry
        # says how many losses were filtered, so a stand-in is never mistaken for a measured loss
        return self.total_loss / self.total_count if self.total_count else 0.0

    def window_mean(self) -> float | None:
        """Mean loss since the last :meth:`take_window` (one host sync), or None if nothing was added."""
        window = self._window()  # this process's: the bar is the main process's alone, no collective
        return None if window is None else self._mean(*window[:2])

    def take_window(self) -> tuple[float, int] | None:
        """The window's mean loss and how many of its losses the filter left out (one host sync), folded into
        the totals; the window starts again. None if nothing was added."""
        window = self._window(everywhere=True)  # every process logs, so every process takes it
        self._window_sum, self._window_finite, self._window_count = None, None, 0
        if window is None:
            return None
        total, count, added = window
        self.total_loss += total
        self.total_count += count
        self.filtered += added - count
        return self._mean(total, count), added - count

    def mean_loss(self) -> float:
        """Mean loss over every micro-batch this run took (a resumed run: since the resume; reads what is left
        in the window); nan when no finite loss was seen."""
        self.take_window()
        total, count = self.total_loss - self._run_base[0], self.total_count - self._run_base[1]
        return total / count if count else float("nan")

    def state_dict(self) -> dict[str, float]:
        """JSON-ready, for checkpoints: the open window too (one host sync), so a resumed run logs the same
        losses as an uninterrupted one."""
        return {
            "window_sum": float(self._window_sum.item()) if self._window_sum is not None else None,
            "window_finite": float(self._window_finite.item()) if self._window_finite is not None else None,
            "window_count": self._window_count,
            "total_loss": self.total_loss,
            "total_count": self.total_count,
        }

    def load_state_dict(self, state: dict[str, float], device: torch.device) -> None:
        if state.get("window_sum") is not None:
            # fp32 sums survive the trip through a Python float exactly
            self._window_sum = torch.tensor(state["window_sum"], dtype=torch.float32, device=device)
        if state.get("window_finite") is not None:
            self._window_finite = torch.tensor(state["window_finite"], dtype=torch.float32, device=device)
        self._window_count = int(state.get("window_count", 0))
        self.total_loss = float(state.get("total_loss", 0.0))
        self.total_count = int(state.get("total_count", 0))
        window_sum, window_finite = state.get("window_sum"), state.get("window_finite")
        counted = int(window_finite) if window_finite is not None else self._window_count
        self._run_base = (self.total_loss + (window_sum or 0.0), self.total_count + counted)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def postfix(self) -> dict[str, str]:
        """What the progress bar shows: loss (one host sync), lr, loss scale and the recent throughput."""
        now = time.perf_counter()
        t0, s0, k0 = self._rate_mark
        dt = max(now - t0, 1e-9)
        self._rate_mark = (now, self.samples, self.tokens)
        shown = {}
        loss = self.window_mean()
        if loss is not None:
            shown["loss"] = f"{loss:.4f}"
        shown["lr"] = f"{self.learning_rate:.2e}"
        shown["scale"] = f"{self._loss_scale():g}"
        if self.tokens:
            shown["tok/s"] = f"{(self.tokens - k0) / dt:.0f}"
        else:
            shown["samples/s"] = f"{(self.samples - s0) / dt:.1f}"
        return shown
