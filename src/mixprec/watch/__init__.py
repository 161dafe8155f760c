"""mixprec.watch: precision during the run, per layer.

``PrecisionWatch`` samples each module's activations and gradients every N steps and logs their *headroom*
(binades left to the format's max, and above its smallest normal), warns when a layer's headroom trends toward
overflow, traces every skipped step to the module whose values went non-finite first, and (opt-in) moves a
module that outgrows fp16 to fp32. Turn it on with ``TrainingArguments(precision_watch=...)``,
``Accelerator(watch=...)`` or ``mixprec train --watch N`` (settings: :mod:`mixprec.watch.settings`).

Files, one concept each: ``headroom`` (sampling), ``trend`` (early warning), ``attribution`` (skipped steps),
``fallback`` (fp32 per module), ``plot`` (the PNG), ``watch`` (the object that runs them in the step).
"""

from mixprec.watch.attribution import SkipAttribution
from mixprec.watch.fallback import fp32_modules, restore, run_in_fp32
from mixprec.watch.headroom import LayerReading, Sample
from mixprec.watch.settings import DEFAULT_EVERY, WatchConfig
from mixprec.watch.trend import HeadroomWarning
from mixprec.watch.watch import PrecisionWatch

__all__ = [
    "DEFAULT_EVERY",
    "HeadroomWarning",
    "LayerReading",
    "PrecisionWatch",
    "Sample",
    "SkipAttribution",
    "WatchConfig",
    "fp32_modules",
    "restore",
    "run_in_fp32",
]
