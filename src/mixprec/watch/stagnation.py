"""bf16 stagnation: the fraction of each layer's update that rounds away instead of changing the weight.

A weight held in bf16 has 8 significant bits: an update smaller than half a unit in the last place (|w| x
2^-9) rounds back to the same value, so with a small learning rate a bf16-pure run (bf16 weights and a plain
optimizer, bf16 gradient accumulation, bf16 optimizer states) stops learning while its loss curve looks
merely flat (Zamirai et al. 2020, arXiv 2010.06192). Nothing fails; the updates just vanish.

On a sampled step the watch copies the weights before the optimizer step and compares after it: an element
whose gradient is nonzero but whose stored value did not move is *stagnant*. Kahan summation keeps what the
rounding lost in a compensation buffer (``state["compensation"]``, :mod:`mixprec.optim.kahan`), so there the
stored value is the weight plus that buffer, and nothing is lost. Stochastic rounding moves a weight by a
whole ulp with probability update/ulp: unbiased, but most elements stay put on any one step, so parameters
an optimizer rounds stochastically are not measured (they would read as stagnant while learning fine).

Cost: on a sampled step only, one fp32 copy of the measured weights (freed at the step's end) and two
elementwise passes; the per-layer fractions stay on the device until the watch's one read at the step's end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.diagnostics.hooks import display_name, param_owners
from mixprec.precision.base import Precision

FIXES = (
    "keep the updates: precision='bf16-pure-kahan' (Kahan summation) or 'bf16-pure' (stochastic rounding), "
    "fp32 master weights (precision='bf16'), or fp32 gradient accumulation and optimizer states"
)
"""The fixes where the run's precision is not known (a probe on its own); a watch asks :func:`stagnation_fixes`."""

FP32_ADVICE = "these weights are fp32 already: the learning rate (or the gradient) is too small for their magnitude"


def stagnation_fixes(precision: Precision) -> str:
    """What keeps the updates, from the facts of the run's own precision: never the rounding it already
    uses, nor the mode it already runs (issue 34: bf16-pure with ``Bf16AdamW(rounding="nearest")`` was told
    to use 'bf16-pure')."""
    if precision.master_weights:  # the mode keeps fp32 masters: these bf16 weights were not given one
        return (
            "keep the updates: prepare the optimizer with the Accelerator (it gives trainable bf16 weights "
            "fp32 masters), or keep the weights in fp32"
        )
    rounding = precision.update_rounding
    others = [r for r in ("kahan", "stochastic") if r != rounding]
    optim = " or ".join(f"Bf16AdamW(rounding={r!r})" for r in others)
    return (
        f"the optimizer {_ROUNDS.get(rounding, f'rounds with {rounding!r}')}; keep the updates with {optim}, "
        "or with fp32 master weights (precision='bf16')"
    )


_ROUNDS = {
    "nearest": "rounds each update to nearest",
    "kahan": "compensates with Kahan summation",
    "stochastic": "rounds stochastically",
}


@dataclass(frozen=True)
class StagnationWarning:
    """A layer whose updates mostly round away."""

    layer: str
    step: int
    stagnant: float
    """Fraction of the layer's elements with a nonzero gradient whose stored value did not change."""
    dtype: str
    """dtype the layer's weights are stored in."""
    fixes: str = FIXES
    """What keeps the updates under the run's precision (``mixprec.watch.stagnation.stagnation_fixes``)."""

    def message(self) -> str:
        """The warning's line, as the ``mixprec.watch`` logger prints it."""
        return (
            f"precision watch: layer {self.layer!r} is not learning at step {self.step}: {self.stagnant:.0%} of "
            f"its updates round away in {self.dtype} (smaller than half an ulp of the weight); {self.advice}"
        )

    @property
    def advice(self) -> str:
        """The run's fixes, or for weights already in fp32 (no precision rounds them coarser): the step's size."""
        return FP32_ADVICE if self.dtype == "float32" else self.fixes

    def to_dict(self) -> dict[str, Any]:
        """The record written to ``metrics.jsonl`` and the run's summary."""
        return {"kind": "stagnation", **asdict(self)}


def stagnation_message(warnings: list[StagnationWarning], shown: int = 4) -> str:
    """One log line for the layers a sample found stagnant (a model's worth of layers at once, not one each)."""
    if len(warnings) == 1:
        return warnings[0].message()
    worst = sorted(warnings, key=lambda w: -w.stagnant)
    names = ", ".join(f"{w.layer} {w.stagnant:.0%}" for w in worst[:shown])
    more = f" and {len(worst) - shown} more" if len(worst) > shown else ""
    return (
        f"precision watch: {len(warnings)} layers are not learning at step {worst[0].step}: most of their updates "
        f"round away in {worst[0].dtype} ({names}{more}); {worst[0].advice}"
    )


def _stochastic(group: dict[str, Any], optimizer: torch.optim.Optimizer) -> bool:
    return group.get("rounding") == "stochastic" or bool(getattr(optimizer, "bf16_stochastic_round", False))


class StagnationProbe:
    """Measures, on the steps it is armed for, each layer's stagnant fraction across the optimizer step."""

    def __init__(self, model: nn.Module) -> None:
        self._owner = {id(p): display_name(owner) for owner, _, p in param_owners(model)}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[RemovableHandle] = []
        self._armed = False
        self._before: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._counts: dict[str, list[torch.Tensor]] = {}
        self.dtypes: dict[str, str] = {}

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Follow ``optimizer``'s steps (hooks on the optimizer object; they do nothing unless armed)."""
        if any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        self._handles.append(optimizer.register_step_pre_hook(lambda opt, a, k: self._before_step(opt)))
        self._handles.append(optimizer.register_step_post_hook(lambda opt, a, k: self._after_step(opt)))

    def arm(self) -> None:
        self._armed = True
        self._counts = {}

    @torch.no_grad()
    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._armed:
            return
        self._before = []
        for group in optimizer.param_groups:
            if _stochastic(group, optimizer) or not float(group.get("lr", 1.0)):  # lr 0 (a frozen group, a warm-up)
                continue  # moves nothing by design
            for p in group["params"]:
                layer = self._owner.get(id(p))
                if p.grad is None or layer is None:
                    continue
                asked = p.grad != 0  # an element with no gradient (an unused embedding row) is not stagnant
                self._before.append((layer, p, _stored(p, optimizer), asked))
                self.dtypes[layer] = str(p.dtype).removeprefix("torch.")

    @torch.no_grad()
    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._armed:
            return
        for layer, p, before, asked in self._before:
            still = (_stored(p, optimizer) == before) & asked
            counts = self._counts.setdefault(layer, [])
            counts.append(torch.stack([still.sum(), asked.sum()]))
        self._before = []

    def finish(self) -> dict[str, torch.Tensor]:
        """Disarm; each measured layer's (stagnant, asked) element counts, still on the device."""
        self._armed = False
        self._before = []
        counts, self._counts = self._counts, {}
        return {layer: torch.stack(c).sum(0) for layer, c in counts.items()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _stored(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The value the optimizer holds for ``p``: the weight itself, plus a Kahan compensation when it keeps one."""
    comp = optimizer.state.get(p, {}).get("compensation")
    if comp is None:
        return p.detach().clone()
    return p.detach().float() + comp.float()


def stagnant_fractions(host_counts: dict[str, list[float]]) -> dict[str, float]:
    """{layer: stagnant fraction} from the counts read back (layers with no gradient left out)."""
    return {layer: still / asked for layer, (still, asked) in host_counts.items() if asked > 0}
