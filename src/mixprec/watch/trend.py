"""Early warning: a layer whose headroom shrinks toward overflow, named before the scaler skips a step.

Activation growth that ends in an fp16 overflow is gradual (Wortsman et al. 2023, arXiv 2304.13013: the
signals precede a loss spike; Fishman et al. 2024, arXiv 2409.12517: outliers emerge late in training), so
the trend of a layer's overflow headroom over the last few samples, fitted by least squares in binades per
step, says roughly when it reaches zero. A layer is warned about once: when the projected overflow is within
the horizon, or whatever the trend when its headroom is already below ``warn_headroom`` binades.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from mixprec.watch.headroom import Sample


@dataclass(frozen=True)
class HeadroomWarning:
    """A layer running out of range."""

    layer: str
    fmt: str
    step: int
    """The sampled step the warning was raised on."""
    headroom: float
    """Binades left between the layer's largest output and the format's max."""
    slope: float | None
    """Binades of headroom lost per step over the recent samples (None: too few samples for a trend)."""
    steps_left: int | None
    """Estimated steps until the layer overflows (None: no shrinking trend, only low headroom)."""
    computes_in: str | None = None
    """The format the run computes in when it is not ``fmt`` (an fp32 run watched against fp16: a what-if)."""

    def message(self) -> str:
        """The warning's line, as the ``mixprec.watch`` logger prints it."""
        when = f"about {self.steps_left} steps left" if self.steps_left is not None else "no trend yet"
        rate = f", losing {self.slope:.3g} binades/step" if self.slope else ""
        what_if = self.computes_in is not None and self.computes_in != self.fmt
        verb = f"would run out of {self.fmt} range" if what_if else f"is running out of {self.fmt} range"
        aside = f" (the run computes in {self.computes_in}: a what-if)" if what_if else ""
        return (
            f"precision watch: layer {self.layer!r} {verb} at step {self.step}{aside}: "
            f"{self.headroom:.2f} binades below the max{rate} ({when})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The record written to ``metrics.jsonl`` and the run's summary."""
        return asdict(self)


def fit_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two distinct x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


class TrendWatch:
    """Keeps each layer's recent overflow headroom and decides which layers to warn about."""

    def __init__(self, horizon: int, warn_headroom: float, points: int) -> None:
        self.horizon = horizon
        self.warn_headroom = warn_headroom
        self.points = points
        self._history: dict[str, deque[tuple[int, float]]] = {}
        self.warned: dict[str, HeadroomWarning] = {}

    def update(self, sample: Sample, exclude: frozenset[str] = frozenset()) -> list[HeadroomWarning]:
        """Add a sample; return the warnings it raises (each layer at most once per run). A skipped step's
        sample is left out (see :attr:`Sample.skipped`), and so are the layers in ``exclude`` (those already
        moved to fp32)."""
        raised: list[HeadroomWarning] = []
        if sample.skipped:
            return raised
        for r in sample.layers:
            if r.act_headroom is None or r.name in exclude:
                continue
            history = self._history.setdefault(r.name, deque(maxlen=self.points))
            history.append((sample.step, r.act_headroom))
            if r.name in self.warned:
                continue
            warning = self._judge(r.name, sample, list(history))
            if warning is not None:
                self.warned[r.name] = warning
                raised.append(warning)
        return raised

    def _judge(self, name: str, sample: Sample, history: list[tuple[int, float]]) -> HeadroomWarning | None:
        headroom = history[-1][1]
        slope = steps_left = None
        if len(history) >= self.points:
            s = fit_slope(history)
            if s < 0:
                slope = -s
                steps_left = int(headroom / slope)
        near = headroom <= self.warn_headroom
        soon = steps_left is not None and steps_left <= self.horizon
        if not (near or soon):
            return None
        return HeadroomWarning(name, sample.fmt, sample.step, headroom, slope, steps_left)

    def forget(self, layer: str) -> None:
        """A layer moved to fp32 starts over (its values are no longer held in the watched format)."""
        self._history.pop(layer, None)
