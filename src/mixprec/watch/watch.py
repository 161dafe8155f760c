"""The precision watch: headroom samples, early warnings, skip attribution and the fp32 fallback, in the run.

::

    accelerator = Accelerator(mixed_precision="fp16", watch="fallback:50")   # or watch=50, or a PrecisionWatch
    model, optimizer = accelerator.prepare(model, optimizer)                 # the watch attaches to the model
    ...                                                                      # the loop, unchanged
    print(accelerator.watch.summary())

or ``TrainingArguments(precision_watch=...)`` / ``mixprec train --watch N``, where the Trainer also writes the
watch's records to metrics.jsonl and TensorBoard, its summary to train_summary.json and a headroom plot.

How it follows the run without hooks in the loop: one forward pre-hook on the prepared model sees each
training forward begin (grad mode on, module in train mode), and the loss scaler's step record (host state,
no sync) says when an optimizer step was taken and whether it was skipped. A step begins at the first forward
after the previous step was recorded; it ends when the record grows (at the next forward, or when the
Trainer's callback or :meth:`~mixprec.PrecisionWatch.sync` asks).

Cost per step when not sampling: one Python hook call, a dict of the batch's references and a copy of the CPU
RNG state (~5 KB). Every ``every`` steps, a sampled step (see :mod:`mixprec.watch.headroom`: one host sync).
On a skipped step, one replay (see :mod:`mixprec.watch.attribution`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.diagnostics.hooks import ROOT_NAME, HookRegistry
from mixprec.precision.formats import FP16, FP32, FloatFormat, format_named
from mixprec.watch import fallback as fp32
from mixprec.watch.attribution import SkipAttribution, StepRecorder, attribute_skip
from mixprec.watch.badstep import BadSteps
from mixprec.watch.headroom import HeadroomSampler, Sample
from mixprec.watch.numerics import NumericsChecks, NumericsWarning
from mixprec.watch.plot import plot_headroom, series_from_samples
from mixprec.watch.settings import WatchConfig
from mixprec.watch.stagnation import stagnation_fixes
from mixprec.watch.summary_text import summary_lines
from mixprec.watch.trend import HeadroomWarning, TrendWatch

if TYPE_CHECKING:
    from mixprec.watch.host import WatchHost

logger = logging.getLogger("mixprec.watch")

Sink = Callable[[str, int, dict[str, Any]], None]
"""Receives each record as (kind, step, fields); kinds: "watch_sample", "precision_warning",
"skip_attribution", "precision_fallback", "numerics_warning" (bf16 stagnation, instability
precursors), "capsule" (a bad step written for ``mixprec replay``)."""

_KEPT = 1000  # samples and attributions kept in memory (the Trainer's metrics.jsonl keeps them all)


class PrecisionWatch:
    """Watches one prepared model's ranges during training (how it follows the run, and what that costs:
    :mod:`mixprec.watch.watch`).

    ``PrecisionWatch(every=50, fallback=True)`` or ``PrecisionWatch(WatchConfig(...))``; then
    ``watch.attach(accelerator, model)`` (``Accelerator(watch=...)`` does it in ``prepare``; any
    :class:`~mixprec.watch.host.WatchHost` will do).
    """

    def __init__(self, config: WatchConfig | int | str | dict | None = None, **settings: Any) -> None:
        parsed = WatchConfig.parse(config if config is not None else "watch", "PrecisionWatch(config=...)")
        if settings:  # keyword settings override the config's (an "off" config included)
            parsed = dataclasses.replace(parsed or WatchConfig(), **settings)
        if parsed is None:
            raise ValueError("PrecisionWatch(config=...): the setting turns the watch off; don't build one")
        self.config: WatchConfig = parsed
        self.model: nn.Module | None = None
        self.samples: deque[Sample] = deque(maxlen=_KEPT)
        self.warnings: list[HeadroomWarning] = []
        self.skips: deque[SkipAttribution] = deque(maxlen=_KEPT)
        self.skip_counts: Counter[str] = Counter()
        """Skipped steps traced to each module (any phase)."""
        self.fallbacks: list[dict[str, Any]] = []
        self.numerics_warnings: list[NumericsWarning] = []
        """bf16 stagnation and instability-precursor warnings (each layer or signal once per run)."""
        self.numerics: deque[dict[str, Any]] = deque(maxlen=_KEPT)
        """Per sampled step: each layer's stagnant update fraction, the attention logit maxima, the mean log Z."""
        self._run_folder: str | Path | None = None
        self._pending_optimizers: list[torch.optim.Optimizer] = []
        self._optimizer_name: str | None = None
        self._sinks: list[Sink] = []
        self._trend = TrendWatch(self.config.horizon, self.config.warn_headroom, self.config.trend_points)
        self._forward_overflows: Counter[str] = Counter()
        self._hooks = HookRegistry()
        self._in_step = False
        self._steps_seen = 0
        self._busy = False
        self._pending_state: dict[str, Any] | None = None
        self.fmt: FloatFormat = format_named(self.config.fmt) if self.config.fmt else FP16
        """The format headroom is measured against (settled by :meth:`attach` when the config leaves it open)."""

    @classmethod
    def build(cls, value: Any, where: str = "Accelerator(watch=...)") -> PrecisionWatch | None:
        """A watch for the setting ``value`` (see :mod:`mixprec.watch.settings`), or None when it is off."""
        if isinstance(value, PrecisionWatch):
            return value
        config = WatchConfig.parse(value, where)
        return cls(config) if config is not None else None

    # -- wiring -----------------------------------------------------------------------------------------

    def attach(self, accelerator: WatchHost, model: nn.Module) -> None:
        """Watch ``model`` (prepared by ``accelerator``, or run by any :class:`~mixprec.watch.host.WatchHost`),
        and save the fallback list in its checkpoints. A watch follows one model: the first attached (an
        Accelerator preparing a second model, a GAN's or a teacher's, leaves it unwatched)."""
        if self.model is not None:
            if model is not self.model:
                watched, other = type(self.model).__name__, type(model).__name__
                logger.info("precision watch: already watching %s; %s is not watched", watched, other)
            return
        self.model = model
        self._host = accelerator  # its scaler is asked each time: "auto"'s is the current mode's
        self._device = accelerator.device
        self._precision = accelerator.precision
        self.fmt = self._run_format()
        self._sampler = HeadroomSampler(model, self._device, self.fmt, self.config.significant)
        self._recorder = StepRecorder(self._device)
        self._numerics = NumericsChecks(model, self.config, lambda: stagnation_fixes(self._precision))
        self._precision_name = lambda: accelerator.precision.name  # "auto" is decided on the first step
        # one writer, one model as it is built: capsules in a single process only (as the skip replay)
        self._capsules = self.config.capsules and accelerator.num_processes == 1
        spike = self.config.spike_factor if self._capsules else None
        self._bad = BadSteps(model, self._recorder, spike, self.config.max_capsules, self._capsule_context)
        folder = self._run_folder if self._run_folder is not None else accelerator.project_dir
        if folder is not None:
            self.set_run_folder(folder)
        self._can_replay = accelerator.num_processes == 1
        # the Accelerator's backward divides each micro-batch's loss by the accumulation steps before scaling
        self._replay_divisor = accelerator.gradient_accumulation_steps
        self._hooks.hook_forward_pre(model, self._before_forward)
        self._hooks.add(model.register_forward_hook(self._after_forward))
        accelerator.register_for_checkpointing(self)
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
        for optimizer in self._pending_optimizers:
            self.watch_optimizer(optimizer)
        self._pending_optimizers = []

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Follow ``optimizer``'s steps too (the Accelerator calls it in ``prepare``): the stagnation sample
        across its step, and with ``spike_factor`` the loss read before it. Hooks on the optimizer object."""
        if self.model is None:  # prepared before the model: followed once the watch has one
            self._pending_optimizers.append(optimizer)
            return
        self._numerics.stagnation.watch_optimizer(optimizer)
        if self.config.spike_factor is not None and self._capsules:
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before_optimizer_step(opt))
        self._optimizer_name = type(optimizer).__name__

    def set_run_folder(self, folder: str | Path) -> None:
        """Where capsules of bad steps go (``<folder>/capsules/step-N``); the Trainer passes its output_dir.
        Without one (an Accelerator with no project_dir), no capsule is written."""
        self._run_folder = folder
        if self.model is not None:
            self._bad.run_folder = Path(folder) if self._capsules else None

    @property
    def capsules(self) -> list[dict[str, Any]]:
        """The capsules written so far: step, reason, path."""
        return list(self._bad.written) if self.model is not None else []

    def add_sink(self, sink: Sink) -> None:
        """Also send every record to ``sink`` (the Trainer sends them to metrics.jsonl and TensorBoard)."""
        self._sinks.append(sink)

    def detach(self) -> None:
        """Remove the watch's hooks (fallen-back modules stay in fp32; see :func:`fallback.restore`)."""
        if self.model is not None:
            self._sampler.cancel()
            self._numerics.stagnation.remove()
        self._hooks.remove_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Steps followed once, taken again (auto's race, replayed in the chosen mode): not followed twice; the
        samples, traces and capsules of them stay the race's, as the run's logged losses and skips do."""
        self.sync()
        self._busy = True
        try:
            yield
        finally:
            self._busy = self._in_step = False

    # -- following the steps ----------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or not torch.is_grad_enabled() or not module.training:
            return  # the replay itself, evaluation, generation
        self.sync()
        if not self._in_step:
            self._begin_step()
        self._recorder.record(args, kwargs)

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._busy or not torch.is_grad_enabled() or not module.training:
            return
        self._bad.on_output(output)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._in_step and not self._busy:
            self._busy = True
            try:
                record = self._bad.before_optimizer_step(self._scaler.record.steps + 1, self._replay_scale())
            finally:
                self._busy = False
            if record is not None:
                self._emit("capsule", record["step"], record)

    def _replay_scale(self, scale: float | None = None) -> float:
        return (self._scaler.get_scale() if scale is None else scale) / self._replay_divisor

    @property
    def _scaler(self) -> Any:
        return self._host.scaler

    def _run_format(self) -> FloatFormat:
        """The config's format, else the narrowest the run may compute in (the precision's own answer; an
        undecided "auto"'s narrowest candidate), and fp16's for an fp32 run: does fp16 hold?"""
        if self.config.fmt is not None:
            return format_named(self.config.fmt)
        fmt = self._precision.narrowest_format()
        return FP16 if fmt is FP32 else fmt

    def _computes_in(self) -> str:
        """The format the run computes in (its narrowest), which the summary names beside a what-if format."""
        return self._precision.narrowest_format().name

    def _capsule_context(self) -> dict[str, Any]:
        return {
            "precision": self._precision_name(),
            "fallbacks": [f["module"] for f in self.fallbacks],
            "optimizer": self._optimizer_name,
        }

    def _begin_step(self) -> None:
        self._in_step = True
        self._steps_seen = self._scaler.record.steps
        self._recorder.new_step()
        self._bad.new_step()
        if (self._steps_seen + 1) % self.config.every == 0:
            self.fmt = self._sampler.fmt = self._run_format()  # "auto" takes its chosen mode's at its decision
            self._sampler.start()
            self._numerics.arm()

    def sync(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Finish the step the scaler has just recorded, if any: the sample, the warnings, and on a skipped
        step the attribution (``optimizer``'s gradients, if not yet zeroed, serve when a replay cannot run).
        Called by the next training forward anyway; the Trainer calls it right after the optimizer step."""
        record = self._scaler.record
        if not self._in_step or record.steps == self._steps_seen:
            return
        self._in_step = False
        self._steps_seen = record.steps
        step = record.steps
        entry = record.history[-1] if record.history else None
        scale = entry.scale if entry is not None else 1.0
        self._busy = True
        try:
            skipped = entry is not None and entry.skipped
            if self._sampler.active:
                self._on_sample(self._sampler.finish(step, scale, skipped))
                self._on_numerics(step, skipped)
            if skipped:
                grads = [] if optimizer is None else _named_grads(self.model, optimizer)
                replay_scale = self._replay_scale(scale)
                att = attribute_skip(self.model, self._recorder, step, replay_scale, grads, self._can_replay)
                self._on_skip(dataclasses.replace(att, loss_scale=scale))
                if self._capsules:
                    # a gradient that overflowed only in backward above scale 1: the scaler's routine backoff
                    backoff = scale if att.phase == "backward" and scale > 1 else None
                    written = self._bad.on_skipped(step, replay_scale, backoff)
                    if written is not None:
                        self._emit("capsule", step, written)
        finally:
            self._busy = False
            self._recorder.new_step()  # drop the batch references now, not at the next step

    def close(self) -> None:
        """Finish a step still open (the last one of a hand-written loop)."""
        if self.model is None:
            return
        self.sync()
        self._sampler.cancel()
        self._numerics.cancel()
        self._in_step = False

    # -- what a step found ------------------------------------------------------------------------------

    def _emit(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink(kind, step, fields)

    def _on_sample(self, sample: Sample) -> None:
        self.samples.append(sample)
        self._emit("watch_sample", sample.step, sample.log_entry())
        fallen = frozenset(f["module"] for f in self.fallbacks)
        for w in self._trend.update(sample, exclude=fallen):
            w = dataclasses.replace(w, computes_in=self._computes_in())  # a frozen record
            self.warnings.append(w)
            logger.warning(w.message())
            self._emit("precision_warning", sample.step, w.to_dict())

    def _on_numerics(self, step: int, skipped: bool) -> None:
        """Read the stagnation and precursor probes of a sampled step (one host sync for both) and warn."""
        entry, fields, raised = self._numerics.finish(step, skipped)
        if not entry:
            return
        self.numerics.append(entry)
        self._emit("watch_sample", step, fields)
        for w in raised:
            self.numerics_warnings.append(w)
            self._emit("numerics_warning", step, w.to_dict())

    def _on_skip(self, att: SkipAttribution) -> None:
        self.skips.append(att)
        for name in [att.module] if att.module else att.modules:
            self.skip_counts[name] += 1
        logger.warning(att.message())
        self._emit("skip_attribution", att.step, att.to_dict())
        # Only a forward overflow is the format's range running out; a backward one is the loss scale being
        # too high, which the scaler answers by lowering it (early fp16 steps skip that way, harmlessly).
        if att.phase != "forward" or att.module is None or att.module == ROOT_NAME:
            return
        self._forward_overflows[att.module] += 1
        warned = att.module in self._trend.warned
        if self.config.fallback and (warned or self._forward_overflows[att.module] >= self.config.fallback_after):
            reason = (
                "overflowed after a headroom warning"
                if warned
                else (f"{self._forward_overflows[att.module]} skipped steps traced to its forward")
            )
            self.fall_back(att.module, att.step, reason)

    def fall_back(self, module_name: str, step: int, reason: str = "asked for") -> None:
        """Run module ``module_name`` (qualified name) in fp32 from the next forward on; logged and saved."""
        module = self.model.get_submodule(module_name)
        if fp32.is_fp32(module):
            return
        fp32.run_in_fp32(module)
        self._trend.forget(module_name)
        record = {"module": module_name, "step": step, "reason": reason, "fmt": self.fmt.name}
        self.fallbacks.append(record)
        logger.warning(
            "precision watch: module %r runs in fp32 from step %d on (%s); the rest stays %s",
            module_name,
            step + 1,
            reason,
            self.fmt.name,
        )
        self._emit("precision_fallback", step, record)

    # -- results ------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What the watch saw: JSON-ready, for train_summary.json."""
        fallen = {f["module"] for f in self.fallbacks}
        drawn = series_from_samples(self.samples)["act_headroom"]  # the plot's: skipped steps left out
        lowest = {name: min(v for _, v in points) for name, points in drawn.items() if name not in fallen}
        tightest = sorted(lowest.items(), key=lambda kv: kv[1])[:5]
        return {
            "every": self.config.every,
            "format": self.fmt.name,
            "computes_in": self._computes_in(),
            "samples": len(self.samples),
            "warnings": [w.to_dict() for w in self.warnings],
            "skipped_steps_by_module": dict(self.skip_counts.most_common()),
            "skips": [a.to_dict() for a in list(self.skips)[-20:]],
            "fp32_fallback": list(self.fallbacks),
            "lowest_headroom": dict(tightest),
            "numerics_warnings": [w.to_dict() for w in self.numerics_warnings],
            "capsules": self.capsules,
            "capsules_not_written": dict(self._bad.not_written) if self.model is not None else {},
            "max_capsules": self.config.max_capsules,
        }

    def summary_lines(self) -> list[str]:
        """The watch's lines in the run's summary (:func:`~mixprec.watch.summary_text.summary_lines`)."""
        return summary_lines(self.summary(), self.numerics_warnings)

    def plot(self, path: str | Path) -> Path:
        """Write the per-layer headroom plot of the samples kept in memory (see :mod:`mixprec.watch.plot`)."""
        return plot_headroom(series_from_samples(self.samples), Path(path), self.fmt.name, self.marks())

    def marks(self) -> dict[str, list[tuple[int, str]]]:
        """The steps to mark on the headroom plot: each warning, skip and fallback with its layer."""
        return {
            "warning": [(w.step, w.layer) for w in self.warnings],
            "skip": [(a.step, a.module or "?") for a in self.skips],
            "fallback": [(f["step"], f["module"]) for f in self.fallbacks],
        }

    # -- checkpoints (Accelerator.register_for_checkpointing) -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain strings and ints (loaded with ``weights_only=True``): the fallback list, above all."""
        return {
            "fallback": [dict(f, step=int(f["step"])) for f in self.fallbacks],
            "forward_overflows": dict(self._forward_overflows),
            "skip_counts": dict(self.skip_counts),
            "warned": sorted(self._trend.warned),
            **self._numerics.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state; the modules that had fallen back run in fp32 again."""
        if self.model is None:  # loaded before attach: apply once there is a model
            self._pending_state = state
            return
        self._pending_state = None
        self._forward_overflows = Counter(state.get("forward_overflows", {}))
        self.skip_counts = Counter(state.get("skip_counts", {}))
        self._numerics.load_state_dict(state)
        for name in state.get("warned", []):
            # the warning itself was logged by the run that raised it; a resume only remembers it was raised
            self._trend.warned.setdefault(name, HeadroomWarning(name, self.fmt.name, -1, 0.0, None, None))
        self.fallbacks = []
        for f in state.get("fallback", []):
            module = self.model.get_submodule(f["module"])
            fp32.run_in_fp32(module)
            self.fallbacks.append(dict(f))
        if self.fallbacks:
            names = ", ".join(f["module"] for f in self.fallbacks)
            logger.info("precision watch: resumed with fp32 fallback for %s", names)


def _named_grads(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor | None]]:
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [(n, p.grad) for n, p in model.named_parameters() if id(p) in in_optimizer]
