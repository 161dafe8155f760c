"""mixprec: mixed-precision training for PyTorch that works as written, on every device.

The public API is re-exported here and imported lazily, so ``import mixprec`` stays light: torch and the
optional libraries (transformers, matplotlib, tensorboard) load only when the names that need them are used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mixprec._version import __version__

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # primitives
    "GradScaler": "mixprec.scaling.scaler",
    "LossScaler": "mixprec.scaling.scaler",
    "ConsecutiveSkipsError": "mixprec.scaling.record",
    "ScaleRecord": "mixprec.scaling.record",
    "Precision": "mixprec.precision.base",
    "PrecisionNotSupportedError": "mixprec.precision.base",
    "resolve_precision": "mixprec.precision.registry",
    "available_precisions": "mixprec.precision.registry",
    "autocast": "mixprec.precision.autocast_context",
    # mid level
    "Accelerator": "mixprec.accelerator.accelerator",
    "ProjectConfiguration": "mixprec.accelerator.project",
    "GradientAccumulationPlugin": "mixprec.accelerator.gradients",
    "PartialState": "mixprec.strategies.process_state",
    "DataLoaderConfiguration": "mixprec.loaders.data_config",
    "skip_first_batches": "mixprec.loaders.data",
    "AcceleratorState": "mixprec.strategies.process_state",
    "DistributedType": "mixprec.strategies.distributed_type",
    # high level
    "Trainer": "mixprec.trainer.trainer",
    "TrainingArguments": "mixprec.trainer.args",
    "Seq2SeqTrainer": "mixprec.trainer.seq2seq",
    "Seq2SeqTrainingArguments": "mixprec.trainer.seq2seq",
    "TrainerCallback": "mixprec.trainer.callbacks",
    "TrainerControl": "mixprec.trainer.callbacks",
    "EarlyStoppingCallback": "mixprec.trainer.callbacks",
    "DefaultFlowCallback": "mixprec.trainer.callbacks",
    "ProgressCallback": "mixprec.trainer.events",
    "PrinterCallback": "mixprec.trainer.events",
    "ExportableState": "mixprec.trainer.callbacks",
    "TrainerState": "mixprec.trainer.state",
    "EvalPrediction": "mixprec.trainer.state",
    "TrainingInterrupted": "mixprec.trainer.signals",
    # tools
    "diagnose": "mixprec.diagnostics.diagnose",
    "PrecisionWatch": "mixprec.watch.watch",
    "WatchConfig": "mixprec.watch.settings",
    "Report": "mixprec.diagnostics.report",
    "GPT": "mixprec.models.gpt",
    "GPTConfig": "mixprec.models.gpt_config",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next lookup skips __getattr__
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.accelerator.gradients import GradientAccumulationPlugin
    from mixprec.accelerator.project import ProjectConfiguration
    from mixprec.diagnostics.diagnose import diagnose
    from mixprec.diagnostics.report import Report
    from mixprec.loaders.data import skip_first_batches
    from mixprec.loaders.data_config import DataLoaderConfiguration
    from mixprec.models.gpt import GPT
    from mixprec.models.gpt_config import GPTConfig
    from mixprec.precision.autocast_context import autocast
    from mixprec.precision.base import Precision, PrecisionNotSupportedError
    from mixprec.precision.registry import available_precisions, resolve_precision
    from mixprec.scaling.record import ConsecutiveSkipsError, ScaleRecord
    from mixprec.scaling.scaler import GradScaler, LossScaler
    from mixprec.strategies.process_state import AcceleratorState, PartialState
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.callbacks import (
        DefaultFlowCallback,
        EarlyStoppingCallback,
        ExportableState,
        TrainerCallback,
        TrainerControl,
    )
    from mixprec.trainer.events import PrinterCallback, ProgressCallback
    from mixprec.trainer.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from mixprec.trainer.signals import TrainingInterrupted
    from mixprec.trainer.state import EvalPrediction, TrainerState
    from mixprec.trainer.trainer import Trainer
    from mixprec.watch.settings import WatchConfig
    from mixprec.watch.watch import PrecisionWatch
