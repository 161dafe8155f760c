"""The fp32 measurement pass: forward and backward with hooks, histograms per module, nothing written back.

Gradients come from ``torch.autograd.grad`` rather than ``loss.backward()``, so ``.grad`` fields are never
touched (pre-existing accumulated gradients survive bit for bit) and parameter post-accumulate hooks that a
user or a distributed wrapper installed do not fire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.histogram import DeviceHistogram, LogHistogram, to_host
from mixprec.diagnostics.hooks import HookRegistry, param_owners
from mixprec.models.outputs import extract_loss

_RECENT = 4
KINDS = ("act", "act_grad", "weight_grad")
"""Histogram kinds: module outputs, gradients of module outputs, gradients of the module's own parameters."""


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a batch (a mapping of keyword arguments) to ``device``."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"a batch must be a dict of keyword arguments for model(**batch), got {type(batch).__name__}")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class _DeviceLayer:
    hists: dict[str, DeviceHistogram]
    update_lost: torch.Tensor
    update_counted: torch.Tensor
    params: int = 0


@dataclass
class LayerMeasurements:
    """What the fp32 pass measured for one module, on the host."""

    name: str
    type: str
    params: int
    hists: dict[str, LogHistogram]
    update_lost: int
    """Nonzero updates that pure-bf16 weights would round away (see :func:`_count_lost_updates`)."""
    update_counted: int
    """Nonzero updates considered."""


@dataclass
class Measurements:
    layers: list[LayerMeasurements]
    totals: dict[str, LogHistogram]
    """Per kind, over the whole model; a tensor returned by a module and its parent is counted once."""
    losses: list[float] = field(default_factory=list)


class _Collector:
    def __init__(self, model: nn.Module, device: torch.device, lr: float, optimizer: str) -> None:
        self.lr = lr
        self.optimizer = optimizer
        self.layers = {
            name: _DeviceLayer(
                {k: DeviceHistogram(device, track_overflow=k == "act") for k in KINDS},
                torch.zeros((), dtype=torch.int64, device=device),
                torch.zeros((), dtype=torch.int64, device=device),
            )
            for name, _ in model.named_modules()
        }
        self.types = {name: type(m).__name__ for name, m in model.named_modules()}
        self.totals = {k: DeviceHistogram(device, track_overflow=k == "act") for k in KINDS}
        self.owners = param_owners(model)
        for owner, _, p in self.owners:
            self.layers[owner].params += p.numel()
        # The same tensor is often returned by a module and then by its parent (a Sequential's last child, a
        # model returning its head's logits next to the loss); those hook calls come close together, so a few
        # recent tensors are enough to keep the model totals free of double counts, without holding every
        # activation (or every activation gradient) alive until the batch ends.
        self._recent: dict[str, deque[torch.Tensor]] = {k: deque(maxlen=_RECENT) for k in ("act", "act_grad")}
        self._loss_id = -1

    def _add(self, kind: str, name: str, t: torch.Tensor) -> None:
        recent = self._recent[kind]
        if any(r is t for r in recent):
            self.layers[name].hists[kind].add(t)
        else:
            self.layers[name].hists[kind].add(t, self.totals[kind])
            recent.append(t)

    def on_output(self, name: str, t: torch.Tensor) -> None:
        self._add("act", name, t)

    def on_output_grad(self, name: str, g: torch.Tensor, tensor_id: int) -> None:
        # d loss / d loss is the backward seed (1 here, the loss scale in training), not a gradient the
        # model computes: counting it would make the largest "gradient" 1 and cap every loss scale at 2^12
        if tensor_id != self._loss_id:
            self._add("act_grad", name, g)

    def run_batch(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        outputs = model(**batch)
        loss = extract_loss(outputs)
        self._loss_id = id(loss)
        params = [p for _, _, p in self.owners]
        if loss.requires_grad and params:
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            with torch.no_grad():
                for (owner, _, p), g in zip(self.owners, grads):
                    if g is None:  # unused by this batch's graph: no gradient, not a zero gradient
                        continue
                    self.layers[owner].hists["weight_grad"].add(g, self.totals["weight_grad"])
                    lost, counted = _count_lost_updates(p, g, self.lr, self.optimizer)
                    self.layers[owner].update_lost += lost
                    self.layers[owner].update_counted += counted
        for recent in self._recent.values():
            recent.clear()
        return loss.detach()

    def finish(self, losses: list[torch.Tensor]) -> Measurements:
        names = list(self.layers)
        device_hists = [self.layers[n].hists[k] for n in names for k in KINDS] + [self.totals[k] for k in KINDS]
        host = to_host(device_hists)
        # counters and losses in a second, small transfer: two host syncs for the whole pass
        counters = torch.stack(
            [torch.stack([self.layers[n].update_lost, self.layers[n].update_counted]) for n in names]
        )
        extra = torch.cat([counters.reshape(-1).double(), torch.stack(losses).double()]).cpu().tolist()
        counts, loss_values = extra[: 2 * len(names)], extra[2 * len(names) :]
        layers = []
        for i, n in enumerate(names):
            hists = {k: host[i * len(KINDS) + j] for j, k in enumerate(KINDS)}
            lost, counted = int(counts[2 * i]), int(counts[2 * i + 1])
            layers.append(LayerMeasurements(n, self.types[n], self.layers[n].params, hists, lost, counted))
        totals = {k: host[len(names) * len(KINDS) + j] for j, k in enumerate(KINDS)}
        return Measurements(layers, totals, loss_values)


def _count_lost_updates(
    p: torch.Tensor, g: torch.Tensor, lr: float, optimizer: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of this step's weight updates a bf16 weight would round away, and how many were nonzero.

    The update is approximated from one gradient: ``-lr * g`` for SGD, and ``-lr * sign(g)`` for Adam (on
    its first step, bias-corrected Adam moves every weight by exactly lr in the direction of -g, ignoring eps;
    later steps have |update| <= ~lr, so this is the optimistic case). An update is lost when
    ``bf16(w_bf16 + u) == w_bf16``: |u| below half a bf16 ULP of the weight (the rounding rule; ties and the
    binade edges are where the two differ by at most a factor of two). Zero updates are not counted.
    """
    u = -lr * (g.sign() if optimizer == "adam" else g).float()
    w = p.detach().to(torch.bfloat16)
    lost = ((w.float() + u).to(torch.bfloat16) == w) & (u != 0)
    return lost.sum(), (u != 0).sum()


def measure(
    model: nn.Module,
    batches: list[dict[str, Any]],
    device: torch.device,
    *,
    lr: float,
    optimizer: str,
) -> Measurements:
    """Run every batch through the model in fp32 with hooks and return the host-side measurements.

    Autocast is switched off explicitly, so an ambient ``torch.autocast`` block does not turn the reference
    pass into a low-precision one. Forces two host syncs at the end (plus whatever the model itself does).
    The caller owns restoring the model's state (:class:`~mixprec.diagnostics._guard.ModelGuard`).
    """
    collector = _Collector(model, device, lr, optimizer)
    losses = []
    with HookRegistry() as hooks:
        hooks.hook_module_outputs(model, collector.on_output, collector.on_output_grad)
        with torch.autocast(device.type, enabled=False):
            for batch in batches:
                losses.append(collector.run_batch(model, batch))
    return collector.finish(losses)
