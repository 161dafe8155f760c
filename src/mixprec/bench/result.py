"""What a precision benchmark measured, and its JSON form (the schema of ``mixprec bench --json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixprec.bench.peak import PeakFlops
from mixprec.bench.timing import Summary

AUTO_TOLERANCE = 0.05
""""auto" is on target when its step is at most this much slower than the fastest precision of the run."""


@dataclass
class PrecisionResult:
    """One row: a precision as asked, what it ran as, and what was measured."""

    precision: str
    """As asked ("auto" stays "auto")."""
    resolved: str
    """The mode that ran: "fp32", "fp16", "bf16", "bf16-pure", ..."""
    reason: str
    compute_dtype: str
    tokens_per_step: int
    times: Summary | None = None
    loss: float | None = None
    """Held-out loss after the run (warm-up + all rounds), scored under this precision's autocast."""
    train_loss: float | None = None
    """Mean training loss over the last round's steps."""
    skipped_steps: int = 0
    """Optimizer steps the loss scaler skipped for non-finite gradients (fp16 only)."""
    final_scale: float = 1.0
    peak_mem_bytes: int | None = None
    peak_mem_source: str = "not measured"
    peak: PeakFlops | None = None
    flops_per_token: float | None = None
    shares_measurement_with: str | None = None
    """For "auto": the row whose run it shares, when that precision was benchmarked too."""
    chosen_by_auto: bool = False
    """True for the "auto" row: its mode is what auto's race chose."""
    skipped: str | None = None
    """Why this precision did not run (the device cannot run it), else None."""
    bytes_per_param: float | None = None
    """Parameters + gradients + optimizer state, bytes per parameter (16 for fp32 AdamW, 8 for bf16-pure)."""

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.times.median if self.times else None

    @property
    def mfu(self) -> float | None:
        if self.peak is None or self.flops_per_token is None or self.tokens_per_s is None:
            return None
        return self.flops_per_token * self.tokens_per_s / self.peak.flops_per_s


@dataclass
class BenchResult:
    """Every row of one run, plus the device and the settings, and the "auto" verdict."""

    device: str
    device_name: str
    threads: int
    torch_version: str
    workload: str
    config: dict[str, Any]
    rows: list[PrecisionResult]
    flops_source: str = ""
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    auto_race: dict[str, Any] | None = None
    """What "auto" measured on the workload's training step before the bench ran (AutoDecision.to_dict())."""

    def row(self, precision: str) -> PrecisionResult | None:
        """The row of ``precision`` as asked (canonical: "fp16", "auto", ...)."""
        return next((r for r in self.rows if r.precision == precision), None)

    def auto_row(self) -> PrecisionResult | None:
        """The row of "auto" (the mode its race chose), if it was benchmarked."""
        return next((r for r in self.rows if r.chosen_by_auto), None)

    def baseline(self) -> PrecisionResult | None:
        """The fp32 row that speedups and losses are relative to (asked as fp32 or as auto -> fp32): the one
        mode that computes in float32."""
        return next((r for r in self.rows if r.compute_dtype == "float32" and r.times is not None), None)

    def fastest(self, among: set[str] | None = None) -> PrecisionResult | None:
        """The fastest row (other than "auto"), optionally among the modes named in ``among``."""
        timed = [r for r in self.rows if r.times is not None and not r.chosen_by_auto]
        if among:
            timed = [r for r in timed if r.resolved in among]
        timed = timed or [r for r in self.rows if r.times is not None]
        return min(timed, key=lambda r: r.times.median) if timed else None

    def auto_verdict(self) -> dict[str, Any] | None:
        """Is "auto" within :data:`AUTO_TOLERANCE` of the fastest precision it could have chosen (its candidates:
        not the pure or fp8 modes, which are a user's trade of accuracy or memory) measured in this run?"""
        candidates = set((self.auto_race or {}).get("candidates") or [])
        auto, best = self.auto_row(), self.fastest(candidates or None)
        if auto is None or auto.times is None or best is None:
            return None
        ratio = auto.times.median / best.times.median
        return {
            "chose": auto.resolved,
            "fastest": best.precision,
            "ratio_to_fastest": ratio,
            "within_tolerance": ratio <= 1 + AUTO_TOLERANCE,
            "tolerance": AUTO_TOLERANCE,
            "reason": auto.reason,
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document. Times in seconds, memory in bytes, MFU as a fraction."""
        base = self.baseline()
        results = []
        for r in self.rows:
            speedup = base.times.median / r.times.median if base and r.times else None
            loss_delta = r.loss - base.loss if base and base.loss is not None and r.loss is not None else None
            results.append(
                {
                    "precision": r.precision,
                    "resolved": r.resolved,
                    "reason": r.reason,
                    "compute_dtype": r.compute_dtype,
                    "skipped": r.skipped,
                    "shares_measurement_with": r.shares_measurement_with,
                    "step_time_s": r.times.median if r.times else None,
                    "step_time_spread_s": r.times.spread if r.times else None,
                    "step_time_min_s": r.times.minimum if r.times else None,
                    "step_time_max_s": r.times.maximum if r.times else None,
                    "timed_steps": r.times.count if r.times else 0,
                    "tokens_per_step": r.tokens_per_step,
                    "tokens_per_s": r.tokens_per_s,
                    "speedup_vs_fp32": speedup,
                    "peak_mem_bytes": r.peak_mem_bytes,
                    "bytes_per_param": r.bytes_per_param,
                    "peak_mem_source": r.peak_mem_source,
                    "loss": r.loss,
                    "loss_vs_fp32": loss_delta,
                    "train_loss": r.train_loss,
                    "skipped_steps": r.skipped_steps,
                    "final_loss_scale": r.final_scale,
                    "mfu": r.mfu,
                    "peak_flops_per_s": r.peak.flops_per_s if r.peak else None,
                    "peak_flops_source": r.peak.source if r.peak else None,
                    "flops_per_token": r.flops_per_token,
                }
            )
        return {
            "device": self.device,
            "device_name": self.device_name,
            "threads": self.threads,
            "torch_version": self.torch_version,
            "workload": self.workload,
            "config": self.config,
            "flops_per_token_source": self.flops_source,
            "step_time_spread": "interquartile range (q3 - q1) of the per-step times, seconds",
            "loss_vs_fp32": "held-out loss minus fp32's, nats (negative: lower than fp32)",
            "results": results,
            "auto": self.auto_verdict(),
            "auto_race": self.auto_race,
            "notes": self.notes,
            "wall_seconds": self.wall_seconds,
        }
