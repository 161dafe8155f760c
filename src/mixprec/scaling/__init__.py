"""Loss scaling: the GradScaler and its per-step record."""

from mixprec.scaling.record import ScaleRecord, StepEntry
from mixprec.scaling.scaler import ConsecutiveSkipsError, GradScaler, LossScaler

__all__ = ["ConsecutiveSkipsError", "GradScaler", "LossScaler", "ScaleRecord", "StepEntry"]
