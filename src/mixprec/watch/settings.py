"""What the precision watch does, parsed in one place from every way a user can ask for it.

``TrainingArguments(precision_watch=...)``, ``Accelerator(watch=...)`` and ``mixprec train --watch ...`` all
accept the same values, and all go through :meth:`~mixprec.WatchConfig.parse`:

- ``None``, ``False``, ``0``, ``"off"``: no watch (the default; nothing is hooked, nothing costs);
- ``N`` (an int, or a string of digits): sample every N optimizer steps, warn and attribute skips;
- ``"watch"``: the same at the default interval;
- ``"fallback"``, ``"fallback:N"``: also move a module that outgrows the format to fp32 (opt-in: it changes
  the run's numerics);
- a ``dict`` of :class:`WatchConfig` fields (a config file's table) or a ``WatchConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mixprec.precision.formats import FORMATS

DEFAULT_EVERY = 100
"""Sampled steps are ~2x a plain step on CPU (a histogram pass over every module's output and output
gradient; see benchmarks/bench_watch.py), so one in 100 keeps the watch's cost at about 1% of the run."""


@dataclass(frozen=True)
class WatchConfig:
    """Settings of a :class:`~mixprec.watch.watch.PrecisionWatch`."""

    every: int = DEFAULT_EVERY
    """Optimizer steps between sampled steps (per-module histograms of activations and their gradients)."""
    fallback: bool = False
    """Run a module in fp32 (autocast off inside it) once it overflows the format: after ``fallback_after``
    skipped steps traced to its forward, or at the first one when the watch had warned about it."""
    fallback_after: int = 2
    """Skipped steps traced to one module's forward before it falls back (1 for a module already warned)."""
    fmt: str | None = None
    """Format the headroom is measured against: "fp16" or "bf16" (None: the run's compute format, and fp16
    for an fp32 run, which then shows whether fp16 would hold)."""
    warn_within: int | None = None
    """Warn when a layer's projected overflow is this many steps away or less (None: 4 sampling intervals)."""
    warn_headroom: float = 1.0
    """Warn, whatever the trend, when a layer's activations come within this many binades of the max."""
    trend_points: int = 3
    """Samples a trend is fitted over (the most recent ones); fewer than this and only warn_headroom warns."""
    significant: float = 0.01
    """Fraction of smallest magnitudes ignored when measuring underflow headroom (the "significant" minimum)."""
    stagnation_warn: float = 0.5
    """Warn when this fraction of a layer's updates rounds away instead of changing the weight (bf16 stagnation,
    :mod:`mixprec.watch.stagnation`); 1 turns the warning off."""
    attn_logit_warn: float = 100.0
    """Warn when the largest attention logit passes this (attention-logit growth, :mod:`mixprec.watch.precursors`;
    the built-in GPT's stay below ~20 in healthy runs)."""
    log_z_drift_warn: float = 3.0
    """Warn when the output log-partition (mean logsumexp of the logits) moves this many nats further from 0
    than on its first sample (output-logit divergence; a log Z falling towards 0 is not warned about)."""
    capsules: bool = True
    """Write a replayable capsule of each bad step into the run folder (:mod:`mixprec.watch.capsule`)."""
    spike_factor: float | None = None
    """Also treat a step as bad when its loss exceeds this many times the median of the last 16 (None: off;
    reads the loss each step, after the step's own sync)."""
    max_capsules: int = 8
    """Capsules written per run at most (each holds the weights)."""

    def __post_init__(self) -> None:
        _check_int("every", self.every, 1)
        _check_int("fallback_after", self.fallback_after, 1)
        _check_int("trend_points", self.trend_points, 2)
        _check_int("max_capsules", self.max_capsules, 0)
        if not 0 < self.stagnation_warn <= 1:
            raise ValueError(f"WatchConfig(stagnation_warn={self.stagnation_warn!r}): a fraction in (0, 1]")
        for name in ("attn_logit_warn", "log_z_drift_warn"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WatchConfig({name}={getattr(self, name)!r}): must be > 0")
        if self.spike_factor is not None and not self.spike_factor > 1:
            raise ValueError(f"WatchConfig(spike_factor={self.spike_factor!r}): must be > 1 (e.g. 3), or None: off")
        if self.warn_within is not None:
            _check_int("warn_within", self.warn_within, 1)
        if self.fmt is not None and self.fmt not in FORMATS:
            raise ValueError(f"WatchConfig(fmt={self.fmt!r}): choose one of {', '.join(FORMATS)} (or None)")
        if not self.warn_headroom >= 0:
            raise ValueError(f"WatchConfig(warn_headroom={self.warn_headroom!r}): must be >= 0 binades")
        if not 0 <= self.significant < 1:
            raise ValueError(f"WatchConfig(significant={self.significant!r}): must be in [0, 1)")

    @property
    def horizon(self) -> int:
        """Steps ahead a projected overflow is warned about."""
        return self.warn_within if self.warn_within is not None else 4 * self.every

    @classmethod
    def parse(cls, value: Any, where: str = "watch") -> WatchConfig | None:
        """The config ``value`` asks for, or None for no watch. ``where`` names the argument in errors
        (e.g. "TrainingArguments(precision_watch=...)")."""
        if isinstance(value, WatchConfig):
            return value
        if value is None or value is False or value == 0 or value == "off":
            return None
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            try:
                return cls(**value)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(
                f"{where}: expected an interval N, 'watch', 'fallback', 'fallback:N' or 'off', got {value!r}"
            )
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"{where}: the interval must be >= 1 step (0 or None: off), got {value}")
            return cls(every=value)
        mode, _, interval = value.strip().lower().partition(":")
        if mode.isdigit() and not interval:
            return cls.parse(int(mode), where)
        if mode not in ("watch", "fallback") or (interval and not interval.isdigit()) or interval == "0":
            raise ValueError(
                f"{where}: {value!r} is not a watch setting; use an interval N, 'watch', 'watch:N', 'fallback', "
                "'fallback:N' or 'off'"
            )
        return cls(every=int(interval) if interval else DEFAULT_EVERY, fallback=mode == "fallback")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"WatchConfig({name}={value!r}): must be an integer >= {low}")
