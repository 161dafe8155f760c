"""Per-layer headroom on a sampled step: how many binades each module's values have left before the format
overflows (above) and before they leave its normal range (below).

A sampled step runs with the diagnosis's hooks (:class:`~mixprec.diagnostics.hooks.HookRegistry`) feeding the
diagnosis's device histograms (:class:`~mixprec.diagnostics.histogram.DeviceHistogram`): nothing here measures
a tensor itself. The values measured are the ones the run really holds: activations in the compute dtype under
autocast (an fp16 overflow is an inf, counted), gradients as backward computes them, i.e. multiplied by the
loss scale (what fp16 must hold).

Cost: on a sampled step only, a few elementwise passes over every module output and output gradient (the
binning itself over at most :data:`BIN_LIMIT` values of each), and one host sync at the end of the step for
all histograms together. Steps in between run with no hook at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.histogram import DeviceHistogram, LogHistogram, to_host
from mixprec.diagnostics.hooks import HookRegistry, display_name
from mixprec.precision.formats import FloatFormat

_RECENT = 4
"""A tensor a module returns is often returned again by its parent right after (a Sequential's last child);
remembering the last few keeps it measured once, under the innermost module, which is the one to act on."""


BIN_LIMIT = 2**16
"""Values binned per tensor on a sampled step (a strided subset of larger tensors): the maxima, overflow and
non-finite counts stay exact, the fractions below the normal range become estimates (from 65,536 values, a
fraction of 1% is known to about +-0.04%). Binning every value made a sampled step of the default GPT 3.8x a
plain step on CPU; see benchmarks/bench_watch.py."""


@dataclass(frozen=True)
class LayerReading:
    """One module's values on one sampled step, measured against one format."""

    name: str
    act_max: float | None
    """Largest finite output magnitude."""
    act_headroom: float | None
    """Binades from act_max up to the format's max (0: some outputs already overflow)."""
    act_low_headroom: int | None
    """Binades from the smallest significant output magnitude down to the smallest normal."""
    act_overflow: float
    """Fraction of output values above the format's max (inf included)."""
    act_subnormal: float
    """Fraction of nonzero output values below the smallest normal."""
    grad_max: float | None
    """Largest finite output-gradient magnitude, as held (times the loss scale)."""
    grad_headroom: float | None
    grad_low_headroom: int | None
    grad_subnormal: float

    @classmethod
    def read(cls, name: str, act: LogHistogram, grad: LogHistogram, fmt: FloatFormat, q: float) -> LayerReading:
        return cls(
            name=name,
            act_max=act.max_abs if act.nonzero else None,
            act_headroom=_round(act.overflow_headroom(fmt)),
            act_low_headroom=act.underflow_headroom(fmt, q),
            act_overflow=act.overflow_fraction(fmt),
            act_subnormal=act.outside_normal_fraction(fmt),
            grad_max=grad.max_abs if grad.nonzero else None,
            grad_headroom=_round(grad.overflow_headroom(fmt)),
            grad_low_headroom=grad.underflow_headroom(fmt, q),
            grad_subnormal=grad.outside_normal_fraction(fmt),
        )

    def scalars(self) -> dict[str, float]:
        """The numeric fields, None left out (for logs and TensorBoard)."""
        return {k: float(v) for k, v in vars(self).items() if k != "name" and v is not None}


@dataclass(frozen=True)
class Sample:
    """Every watched module's reading on one step."""

    step: int
    loss_scale: float
    fmt: str
    layers: list[LayerReading]
    skipped: bool = False
    """The step was skipped: its non-finite values spread downstream of where they began, so every layer
    after the overflow reads 0 headroom. Logged and plotted, but kept out of trends (the attribution names
    the layer where it began)."""

    def log_entry(self) -> dict[str, float]:
        """Flat ``{"watch/<layer>/<field>": value}``: one log line per sample, one TensorBoard scalar each."""
        out = {"watch/loss_scale": self.loss_scale, "watch/step_skipped": float(self.skipped)}
        for r in self.layers:
            out.update({f"watch/{r.name}/{k}": v for k, v in r.scalars().items()})
        return out


class HeadroomSampler:
    """Hooks one step's forward and backward, then reads every module's histograms back in one transfer."""

    def __init__(self, model: nn.Module, device: torch.device, fmt: FloatFormat, significant: float) -> None:
        self.model = model
        self.device = device
        self.fmt = fmt
        self.significant = significant
        self._hooks = HookRegistry()
        self._hists: dict[str, tuple[DeviceHistogram, DeviceHistogram]] = {}
        self._recent: deque[torch.Tensor] = deque(maxlen=_RECENT)

    @property
    def active(self) -> bool:
        return bool(self._hists)

    def start(self) -> None:
        """Hook every module for the micro-batches until :meth:`finish` (gradient accumulation: all of them)."""
        self._hists = {
            name: (
                DeviceHistogram(self.device, bin_limit=BIN_LIMIT),
                DeviceHistogram(self.device, track_overflow=False, bin_limit=BIN_LIMIT),
            )
            for name, _ in self.model.named_modules()
        }
        self._hooks.hook_module_outputs(self.model, self._on_output, self._on_output_grad)

    def _on_output(self, name: str, t: torch.Tensor) -> bool:
        if any(r is t for r in self._recent):
            return False  # already measured under a child module
        self._recent.append(t)
        self._hists[name][0].add(t)
        return t.dim() > 0  # a scalar output is the loss: its gradient is the backward seed, not the model's

    def _on_output_grad(self, name: str, g: torch.Tensor, _tensor_id: int) -> None:
        self._hists[name][1].add(g)

    def finish(self, step: int, loss_scale: float, skipped: bool = False) -> Sample:
        """Remove the hooks and read the histograms back. Forces one host sync."""
        self._hooks.remove_all()
        self._recent.clear()
        names = [n for n, (act, grad) in self._hists.items() if act.total or grad.total]
        host = to_host([h for n in names for h in self._hists[n]])
        self._hists = {}
        layers = [
            LayerReading.read(display_name(n), host[2 * i], host[2 * i + 1], self.fmt, self.significant)
            for i, n in enumerate(names)
        ]
        return Sample(step, loss_scale, self.fmt.name, layers, skipped)

    def cancel(self) -> None:
        self._hooks.remove_all()
        self._recent.clear()
        self._hists = {}


def _round(x: Any) -> float | None:
    return None if x is None else round(float(x), 3)
