"""mixprec.diagnostics: see fp16/bf16 underflow and overflow before they cost a run.

``diagnose(model, batches) -> Report``; ``Report.table()``, ``Report.to_dict()``, ``Report.plot(path)``.
"""

from mixprec.diagnostics.diagnose import DiagnoseConfig, diagnose
from mixprec.diagnostics.nonfinite import NonfiniteEvent, find_first_nonfinite
from mixprec.diagnostics.report import LayerStats, Report
from mixprec.models.outputs import extract_loss

__all__ = [
    "DiagnoseConfig",
    "LayerStats",
    "NonfiniteEvent",
    "Report",
    "diagnose",
    "extract_loss",
    "find_first_nonfinite",
]
