"""HF's memory metrics (``TrainingArguments(skip_memory_metrics=False)``): for each stage of the Trainer,
``<stage>_mem_cpu_alloc_delta`` / ``<stage>_mem_cpu_peaked_delta`` (and ``_gpu_`` on CUDA), in bytes.

Stages, HF's names: ``init`` (building the Trainer; reported with the first ``train()``'s metrics), ``train``,
``eval`` (``evaluate()``, its metrics dict) and ``test`` (``predict()``). A stage begun inside another (an
evaluation during training) is not measured apart: the outer one counts it, as HF.

- ``alloc_delta``: memory held at the stage's end minus at its start (negative when the stage freed more).
- ``peaked_delta``: how far above the end level the stage peaked (>= 0).

CPU: the resident set, and its peak as the kernel keeps it (VmHWM, reset at the stage's start), the way
:mod:`mixprec.bench.memory` measures; no polling thread (HF's spins a core). Off Linux the CPU metrics are
left out, not guessed. CUDA: ``memory_allocated`` and ``max_memory_allocated`` (peak reset at the stage's
start). Resetting the peak marks means the end-of-run summary's peak is the training stage's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mixprec.bench.memory import proc_status_bytes, reset_peak_rss


class MemoryMetrics:
    """Measures one stage at a time; does nothing when ``enabled`` is False (HF's default)."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self._stage: str | None = None
        self._begin: dict[str, int] = {}
        self._init_metrics: dict[str, int] | None = None

    def start(self, stage: str) -> None:
        """Begin measuring ``stage`` (ignored inside another stage)."""
        if not self.enabled or self._stage is not None:
            return
        self._stage = stage
        self._begin = {}
        rss = proc_status_bytes("VmRSS")
        if rss is not None and reset_peak_rss():
            self._begin["cpu"] = rss
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._begin["gpu"] = torch.cuda.memory_allocated(self.device)

    def stop(self, stage: str, metrics: dict[str, Any] | None = None) -> None:
        """End ``stage`` and add its metrics to ``metrics`` (the first ``train`` also gets ``init``'s)."""
        if not self.enabled or self._stage != stage:
            return
        measured = self._measure(stage)
        self._stage = None
        if stage == "init":
            self._init_metrics = measured
            return
        if metrics is None:
            return
        if stage == "train" and self._init_metrics is not None:
            metrics.update(self._init_metrics)
            self._init_metrics = None
        metrics.update(measured)

    @contextlib.contextmanager
    def measure(self, stage: str) -> Iterator[dict[str, int]]:
        """``stage`` while the block runs: the dict it yields holds the stage's metrics after the block (empty
        when disabled, nested, or already ended by :meth:`stop` inside it). An error ends the stage unmeasured."""
        measured: dict[str, int] = {}
        self.start(stage)
        try:
            yield measured
        except BaseException:
            if self._stage == stage:
                self._stage = None
            raise
        self.stop(stage, measured)

    def _measure(self, stage: str) -> dict[str, int]:
        out: dict[str, int] = {}
        if "cpu" in self._begin:
            now, peak = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
            if now is not None and peak is not None:
                out[f"{stage}_mem_cpu_alloc_delta"] = now - self._begin["cpu"]
                out[f"{stage}_mem_cpu_peaked_delta"] = max(0, peak - now)
        if "gpu" in self._begin:
            torch.cuda.synchronize(self.device)
            now, peak = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
            out[f"{stage}_mem_gpu_alloc_delta"] = now - self._begin["gpu"]
            out[f"{stage}_mem_gpu_peaked_delta"] = max(0, peak - now)
        return out
