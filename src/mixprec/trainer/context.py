"""What one ``Trainer.train()`` hands down to its helpers: the loop, checkpointing, the summary.

The Trainer builds a :class:`RunContext` once the model, optimizer and scheduler are prepared, and passes it
down; the helpers take it (or only the pieces they use), never the Trainer, so control flows one way:
Trainer -> loop -> checkpointing/summary. Its functions from the Trainer (``training_step``, ``compute_loss``,
``evaluate``, ``log``) are HF's override points: a subclass's override runs, as in HF.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.accelerator.prepared import PreparedOptimizer, PreparedScheduler
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.callbacks import TrainerControl
    from mixprec.trainer.events import RunEvents
    from mixprec.trainer.memory_metrics import MemoryMetrics
    from mixprec.trainer.meter import StepMeter
    from mixprec.trainer.state import TrainerState


@dataclass
class RunContext:
    """One training run's objects, prepared."""

    accelerator: Accelerator
    """Precision, loss scaling, accumulation, processes and checkpoint files."""
    args: TrainingArguments
    events: RunEvents
    """Callbacks, log_history, metrics.jsonl and the progress bar; owns ``state`` and ``control``."""
    meter: StepMeter
    """Running loss, samples and tokens, and the clock."""
    model: torch.nn.Module
    """The prepared model."""
    optimizer: PreparedOptimizer
    lr_scheduler: PreparedScheduler
    train_loader: Any
    """The prepared training DataLoader."""
    compute_loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    """The loss of one batch (``Trainer.compute_loss``, an override included)."""
    training_step: Callable[[torch.nn.Module, Any], torch.Tensor]
    """Loss and backward of one micro-batch, returning the detached loss (``Trainer.training_step``)."""
    count_items: Callable[[list[Any]], Any] | None
    """How a window's label tokens are counted for ``compute_loss_func`` (loss_items.py); None without one."""
    evaluate: Callable[[], dict[str, float]]
    """Evaluate on the evaluation set and log the metrics (``Trainer.evaluate``)."""
    log: Callable[[dict[str, Any]], None]
    """Log an entry: log_history and every logger (``Trainer.log``)."""
    resume_command: str = "trainer.train(resume_from_checkpoint=True)"
    """How the user continues this run, for the stop and disk-full messages."""
    diagnosis: Any = None
    """The ``diagnose_at_start`` report, if one ran."""
    memory: MemoryMetrics | None = None
    """HF's memory metrics (``skip_memory_metrics=False``); the summary ends the "train" stage."""
    sized_by: int = 0
    """The number of processes whose epochs counted the run's steps (a resume at another world size keeps
    them: world_change.py); set by the loop."""

    @property
    def state(self) -> TrainerState:
        return self.events.state

    @property
    def control(self) -> TrainerControl:
        return self.events.control
