"""Loss scaling: the GradScaler and its per-step record."""

from mixprec.scaling.record import ConsecutiveSkipsError, ScaleRecord, StepEntry
from mixprec.scaling.scaler import GradScaler, LossScaler

__all__ = ["ConsecutiveSkipsError", "GradScaler", "LossScaler", "ScaleRecord", "StepEntry"]
