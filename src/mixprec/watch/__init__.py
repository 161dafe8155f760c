"""mixprec.watch: precision during the run, per layer.

``PrecisionWatch`` samples each module's activations and gradients every N steps and logs their *headroom*
(binades left to the format's max, and above its smallest normal), warns when a layer's headroom trends toward
overflow, traces every skipped step to the module whose values went non-finite first, and (opt-in) moves a
module that outgrows fp16 to fp32. Turn it on with ``TrainingArguments(precision_watch=...)``,
``Accelerator(watch=...)`` or ``mixprec train --watch N`` (settings: :mod:`mixprec.watch.settings`).

Files, one concept each: ``headroom`` (sampling), ``trend`` (early warning), ``attribution`` (skipped steps),
``fallback`` (fp32 per module), ``plot`` (the PNG), ``watch`` (the object that runs them in the step);
``stagnation`` (bf16 updates that round away), ``precursors`` (attention-logit growth, output log Z drift),
``numerics`` (the two on a sampled step), ``badstep`` + ``capsule`` (a bad step kept for replay) and
``replay`` (``mixprec replay``: fp32 against the run's precision, the first module apart).
"""

from mixprec.watch.attribution import SkipAttribution
from mixprec.watch.capsule import Capsule
from mixprec.watch.fallback import fp32_modules, restore, run_in_fp32
from mixprec.watch.headroom import LayerReading, Sample
from mixprec.watch.precursors import InstabilityWarning
from mixprec.watch.replay import ReplayResult, replay
from mixprec.watch.settings import DEFAULT_EVERY, WatchConfig
from mixprec.watch.stagnation import StagnationWarning
from mixprec.watch.trend import HeadroomWarning
from mixprec.watch.watch import PrecisionWatch

__all__ = [
    "DEFAULT_EVERY",
    "Capsule",
    "HeadroomWarning",
    "InstabilityWarning",
    "LayerReading",
    "PrecisionWatch",
    "ReplayResult",
    "Sample",
    "SkipAttribution",
    "StagnationWarning",
    "WatchConfig",
    "fp32_modules",
    "replay",
    "restore",
    "run_in_fp32",
]
