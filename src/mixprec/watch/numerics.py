"""The numerics checks of a sampled step, together: bf16 stagnation and the instability precursors.

Both probes arm when a sampled step begins and are read back when it ends, in one transfer for both (one
host sync on a sampled step, none on the others). This object turns the readings into a log entry
(``watch/<layer>/stagnant``, ``watch/<module>/attn_logit_max``, ``watch/log_z``) and into warnings, each layer
or signal once per run; what was warned, and the log Z baseline, survive a resume through its state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.watch.precursors import InstabilityWarning, PrecursorJudge, PrecursorProbe
from mixprec.watch.settings import WatchConfig
from mixprec.watch.stagnation import FIXES, StagnationProbe, StagnationWarning, stagnant_fractions, stagnation_message

logger = logging.getLogger("mixprec.watch")

NumericsWarning = StagnationWarning | InstabilityWarning


class NumericsChecks:
    """Arms the stagnation and precursor probes on sampled steps and judges what they read."""

    def __init__(self, model: nn.Module, config: WatchConfig, fixes: Callable[[], str] | None = None) -> None:
        self.stagnation = StagnationProbe(model)
        self.fixes = fixes  # the stagnation fixes under the run's precision, asked when a warning is made
        self.precursors = PrecursorProbe(model)
        self.judge = PrecursorJudge(config.attn_logit_warn, config.log_z_drift_warn, self.precursors.z_loss)
        self.stagnation_warn = config.stagnation_warn
        self.stagnant_warned: set[str] = set()

    def arm(self) -> None:
        self.stagnation.arm()
        self.precursors.arm()

    def cancel(self) -> None:
        self.stagnation.finish()
        self.precursors.finish()

    def finish(self, step: int, skipped: bool) -> tuple[dict[str, Any], dict[str, float], list[NumericsWarning]]:
        """Disarm and read back (one host sync): the step's entry, its log fields, and the new warnings."""
        counts = self.stagnation.finish()
        readings = self.precursors.finish()
        if not counts and not readings:
            return {}, {}, []
        values = torch.cat([t.reshape(-1).double() for t in [*counts.values(), *readings.values()]]).tolist()
        host_counts = {k: values[2 * i : 2 * i + 2] for i, k in enumerate(counts)}
        host_readings = dict(zip(readings, values[2 * len(counts) :]))
        stagnant = {} if skipped else stagnant_fractions(host_counts)  # a skipped step changed nothing
        fields = {f"watch/{k}/stagnant": v for k, v in stagnant.items()}
        for k, v in host_readings.items():
            fields["watch/log_z" if k == "log_z" else f"watch/{k.removeprefix('attn:')}/attn_logit_max"] = v
        fixes = self.fixes() if self.fixes is not None else FIXES
        stagnating = [
            StagnationWarning(layer, step, frac, self.stagnation.dtypes.get(layer, "?"), fixes)
            for layer, frac in stagnant.items()
            if frac >= self.stagnation_warn and layer not in self.stagnant_warned
        ]
        self.stagnant_warned.update(w.layer for w in stagnating)
        if stagnating:
            logger.warning(stagnation_message(stagnating))
        # a skipped step's readings are its overflow's (log Z nan), which the skip trace explains: no precursor
        precursors = [] if skipped else self.judge.update(step, host_readings)
        for w in precursors:
            logger.warning(w.message())
        return {"step": step, "stagnant": stagnant, **host_readings}, fields, [*stagnating, *precursors]

    def state_dict(self) -> dict[str, Any]:
        return {
            "stagnant_warned": sorted(self.stagnant_warned),
            "precursors_warned": sorted(self.judge.warned),
            "log_z_baseline": self.judge.log_z_baseline,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a resumed run measures drift from where the run began, and does not repeat what it already said
        self.stagnant_warned = set(state.get("stagnant_warned", []))
        self.judge.warned = set(state.get("precursors_warned", []))
        self.judge.log_z_baseline = state.get("log_z_baseline")
