"""Which steps get a capsule: a non-finite step (any precision), or, when asked, a loss spike.

A non-finite step is known from the scaler's step record (the loss scaler in fp16, the non-finite guard in
every other mode): host state, no sync of its own. A spike needs the loss's value: with ``spike_factor`` set,
the optimizer's pre-step hook reads the step's loss (one scalar; the scaler or the guard has just synced on
this step's gradients, so the value is ready and the read does not stall the device) and compares it with
the median of the last :data:`WINDOW` steps. It is caught there, before the update, so the capsule holds the
weights the bad step started from.

A routine fp16 scale backoff (a step whose gradients overflowed only in backward, at a loss scale above 1: the
scaler halves the scale and skips it, many times in a run's first steps) gets one capsule, the first, to
replay and see for what it is; the later ones get none and do not count against ``max_capsules``, which is
kept for the steps that tell something. A bad step past the limit is said once in the log, and the summary
counts the steps left without a capsule.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.models.outputs import extract_loss
from mixprec.watch.attribution import StepRecorder
from mixprec.watch.capsule import write_capsule

logger = logging.getLogger("mixprec.watch")

WINDOW = 16
"""Steps whose median loss a spike is measured against (and the steps seen before spikes are looked for)."""


class BadSteps:
    """Keeps the step's losses (by reference) and writes a capsule for a bad step into ``run_folder``."""

    def __init__(
        self,
        model: nn.Module,
        recorder: StepRecorder,
        spike_factor: float | None,
        max_capsules: int,
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self.model = model
        self.recorder = recorder
        self.spike_factor = spike_factor
        self.max_capsules = max_capsules
        self._describe = describe  # precision, loss scale, fallbacks: the watch's view, read when writing
        self.run_folder: Path | None = None
        self.written: list[dict[str, Any]] = []
        self.not_written = {"limit": 0, "backoff": 0}
        """Bad steps without a capsule: past ``max_capsules``, and scale backoffs after the first."""
        self._budget_used = 0  # capsules counted against max_capsules (not the one backoff capsule)
        self._backoff_capsule: int | None = None
        self._losses: list[torch.Tensor] = []
        self._recent: deque[float] = deque(maxlen=WINDOW)

    def new_step(self) -> None:
        self._losses = []

    def on_output(self, output: Any) -> None:
        """The model's output of a training micro-batch: keep its loss (a reference; no copy, no sync)."""
        # a model without a loss in its output: spikes cannot be seen, non-finite steps still are
        with contextlib.suppress(ValueError):
            self._losses.append(extract_loss(output).detach())

    def step_loss(self) -> float | None:
        """The step's loss summed over micro-batches. Forces a host sync (after the step's own, on a bad step
        or with spike detection only)."""
        if not self._losses:
            return None
        return float(torch.stack([loss.float() for loss in self._losses]).sum())

    def before_optimizer_step(self, step: int, loss_scale: float) -> dict[str, Any] | None:
        """With spike detection on: read the loss, and write a capsule when it spiked. Returns the record."""
        if self.spike_factor is None:
            return None
        loss = self.step_loss()
        if loss is None:
            return None
        median = statistics.median(self._recent) if len(self._recent) == WINDOW else None
        self._recent.append(loss)
        if median is None or not loss > self.spike_factor * median:
            return None
        return self.write(step, f"loss {loss:.4g} > {self.spike_factor:g} x median {median:.4g}", loss, loss_scale)

    def on_skipped(self, step: int, loss_scale: float, backoff_at: float | None = None) -> dict[str, Any] | None:
        """A step whose gradients were non-finite (the scaler or the guard skipped it): write its capsule.
        ``backoff_at``: the loss scale, when the step overflowed only in backward above scale 1 (a backoff)."""
        if backoff_at is None:
            return self.write(step, "non-finite gradients: the step was skipped", self.step_loss(), loss_scale)
        if self._backoff_capsule is not None:
            self.not_written["backoff"] += 1
            return None
        reason = f"gradients overflowed at loss scale {backoff_at:g}: a loss-scale backoff, the step was skipped"
        record = self.write(step, reason, self.step_loss(), loss_scale, budget=False)
        if record is not None:
            self._backoff_capsule = step
        return record

    def write(
        self, step: int, reason: str, loss: float | None, loss_scale: float, budget: bool = True
    ) -> dict[str, Any] | None:
        """Write the capsule of the current step (``loss_scale``: the one its backward used, divided by the
        accumulation steps as the replay's backward needs); ``budget``: count it against ``max_capsules``."""
        if self.run_folder is None:
            return None
        if budget and self._budget_used >= self.max_capsules:
            if not self.not_written["limit"]:
                logger.warning(
                    "precision watch: step %d (%s): no capsule, the limit of %d per run is reached "
                    "(WatchConfig.max_capsules); later bad steps get none either",
                    step,
                    reason,
                    self.max_capsules,
                )
            self.not_written["limit"] += 1
            return None
        batches = self.recorder.batches
        if not batches or any(b is None for b in batches) or self.recorder.rng is None:
            logger.info("precision watch: step %d (%s) has no keyword batch to keep; no capsule", step, reason)
            return None
        try:
            path = write_capsule(
                self.run_folder,
                step=step,
                reason=reason,
                model=self.model,
                batches=batches,
                rng=self.recorder.rng,
                loss=loss,
                loss_scale=loss_scale,
                **self._describe(),
            )
        except (OSError, ValueError) as err:  # a full disk or an odd batch must not end the run
            logger.warning("precision watch: no capsule for step %d: %s", step, err)
            return None
        record = {"step": step, "reason": reason, "path": str(path)}
        self.written.append(record)
        self._budget_used += budget
        logger.warning(
            "precision watch: step %d: %s; capsule %s (replay it: mixprec replay %s)", step, reason, path, path
        )
        return record
