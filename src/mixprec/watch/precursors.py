"""Instability precursors: attention-logit growth and output-logit divergence, named before the loss spikes.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities", arXiv
2309.14322) trace the loss spikes of high-learning-rate runs to two signals that grow first:

- **attention-logit growth**: the largest q . k / sqrt(d) grows until softmax attends to one key (entropy
  collapse); the remedy is qk-layernorm, or a lower learning rate;
- **output-logit divergence**: the output log-partition log Z = logsumexp(logits) moves away from 0 (the
  logits stop being log-probabilities: Wortsman et al. see them grow very negative, large ones risk overflow);
  the remedy is the z-loss (1e-4 x mean(log Z^2), which pulls log Z to 0), or a lower learning rate. The drift
  is measured as |log Z| growing past its first sample's: a log Z falling towards 0 (from log(vocab) at
  initialisation, or from an early rise, as a healthy run's does) is the z-loss's own direction, not a
  precursor; one rising, or falling far below 0, is.

Both are read on the watch's sampled steps. The attention logit comes from modules that keep it themselves
(``track_logit_max`` / ``logit_max``: the built-in GPT's attention, which recomputes q @ k^T in fp32 on those
steps only: the fused kernel never materialises it); log Z from the model's output ``logits`` (any causal LM
returning them), through one forward hook on the model for that step. Both stay on the device until the
watch's one read at the end of the step: no host sync of their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.hooks import HookRegistry, display_name

REMEDIES = {
    "attention_logit": "add qk-layernorm, or lower the learning rate (or lengthen its warm-up)",
    "log_partition": "add a z-loss of 1e-4 (the built-in GPT: mixprec train --z-loss 1e-4, or GPTConfig(z_loss=1e-4) "
    "in Python), or lower the learning rate",
}


def _log_partition_remedy(z_loss: float | None) -> str:
    """What to do about a drifting log Z, given the z-loss the model already has (None: the model has no
    z-loss setting; the built-in GPT's is named in both spellings, the command line's and Python's)."""
    if not z_loss:
        return REMEDIES["log_partition"]
    raised = z_loss * 10
    return (
        f"the z-loss already on ({z_loss:g}) does not hold it: raise it (e.g. mixprec train --z-loss "
        f"{raised:g}, or GPTConfig(z_loss={raised:g}) in Python), or lower the learning rate (or lengthen "
        "its warm-up)"
    )


@dataclass(frozen=True)
class InstabilityWarning:
    """A precursor of divergence past its threshold."""

    signal: str
    """"attention_logit" (the largest attention logit) or "log_partition" (drift of the mean output log Z)."""
    where: str
    """The attention module with the largest logit, or "<model>" for the output."""
    step: int
    value: float
    """The largest attention logit, or the mean log Z."""
    threshold: float
    baseline: float | None = None
    """For log_partition: the mean log Z on the first sample (the drift is measured from it)."""
    z_loss: float | None = None
    """For log_partition: the z-loss weight the model already trains with (None: it has no such setting)."""

    def message(self) -> str:
        if self.signal == "attention_logit":
            what = f"the largest attention logit in {self.where!r} reached {self.value:.1f} (> {self.threshold:g})"
            remedy = REMEDIES[self.signal]
        else:
            what = (
                f"the output log-partition moved from {self.baseline:.2f} to {self.value:.2f}, away from 0 "
                f"(|log Z| up by more than {self.threshold:g} nats)"
            )
            remedy = _log_partition_remedy(self.z_loss)
        return (
            f"precision watch: instability precursor at step {self.step}: {what}; a loss spike often follows "
            f"(Wortsman et al. 2023): {remedy}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "instability", **asdict(self)}


class PrecursorProbe:
    """Turns the precursor readings on for one sampled step and collects them, on the device."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._attention = [(display_name(n), m) for n, m in model.named_modules() if hasattr(m, "track_logit_max")]
        self._hooks = HookRegistry()
        self._log_z: list[torch.Tensor] = []
        self.z_loss = _z_loss_of(model)

    def arm(self) -> None:
        for _, m in self._attention:
            m.track_logit_max, m.logit_max = True, None
        self._log_z = []
        self._hooks.add(self.model.register_forward_hook(self._on_output))

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if isinstance(logits, torch.Tensor) and logits.is_floating_point():
            with torch.no_grad():
                self._log_z.append(torch.logsumexp(logits.detach().float(), dim=-1).mean())

    def finish(self) -> dict[str, torch.Tensor]:
        """Disarm; {"attn:<module>": max logit, "log_z": mean log Z} for what was seen, still on the device."""
        self._hooks.remove_all()
        out: dict[str, torch.Tensor] = {}
        for name, m in self._attention:
            if m.logit_max is not None:
                out[f"attn:{name}"] = m.logit_max.float()
            m.track_logit_max, m.logit_max = False, None
        if self._log_z:
            out["log_z"] = torch.stack(self._log_z).mean()
        self._log_z = []
        return out


class PrecursorJudge:
    """Decides from each sample's readings which precursors to warn about (each signal once per run)."""

    def __init__(self, attn_logit_warn: float, log_z_drift_warn: float, z_loss: float | None = None) -> None:
        self.z_loss = z_loss
        self.attn_logit_warn = attn_logit_warn
        self.log_z_drift_warn = log_z_drift_warn
        self.log_z_baseline: float | None = None
        self.warned: set[str] = set()

    def update(self, step: int, readings: dict[str, float]) -> list[InstabilityWarning]:
        raised: list[InstabilityWarning] = []
        attention = {k.removeprefix("attn:"): v for k, v in readings.items() if k.startswith("attn:")}
        if attention and "attention_logit" not in self.warned:
            where, top = max(attention.items(), key=lambda kv: kv[1])
            if top > self.attn_logit_warn:
                raised.append(InstabilityWarning("attention_logit", where, step, top, self.attn_logit_warn))
        log_z = readings.get("log_z")
        if log_z is not None:
            if self.log_z_baseline is None:
                self.log_z_baseline = log_z
            # away from 0 only: the z-loss pulls log Z to 0, and a healthy run's falls there from log(vocab)
            drift = abs(log_z) - abs(self.log_z_baseline)
            if "log_partition" not in self.warned and (drift > self.log_z_drift_warn or log_z != log_z):
                raised.append(
                    InstabilityWarning(
                        "log_partition",
                        display_name(""),
                        step,
                        log_z,
                        self.log_z_drift_warn,
                        self.log_z_baseline,
                        self.z_loss,
                    )
                )
        self.warned.update(w.signal for w in raised)
        return raised


def _z_loss_of(model: nn.Module) -> float | None:
    """The z-loss weight of the model's config (the built-in GPT's ``GPTConfig.z_loss``), found through any
    wrapper; None for a model without one."""
    for module in model.modules():
        value = getattr(getattr(module, "config", None), "z_loss", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None
