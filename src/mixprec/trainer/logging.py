"""Where logs go: ``metrics.jsonl`` always, TensorBoard when installed and ``report_to`` asks.

Both are callbacks on ``on_log`` and run on the main process only (the Trainer adds them there). The JSONL
file is the run's complete record: training and evaluation entries (the same dicts as ``state.log_history``)
plus events the history does not hold: the start of each run (and of each resume), each skipped step with
the parameters whose gradients were non-finite, and each change of the loss scale. The file is appended
to, so several runs in one output_dir follow each other; the plots are drawn from the latest.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mixprec.trainer.callbacks import TrainerCallback

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf"/"nan": strict JSON has no literal for them
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if hasattr(value, "item") and callable(value.item):
        return _jsonable(value.item())
    return value


class JsonlLogger(TrainerCallback):
    """Appends one JSON object per line to ``<output_dir>/metrics.jsonl`` and flushes it at once, so a
    killed run's file is complete up to its last line."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, entry: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **entry}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.write({"step": state.global_step, "epoch": state.epoch, **(logs or {})})

    def event(self, name: str, step: int, **fields: Any) -> None:
        """A record outside log_history: ``{"event": name, "step": step, ...}``."""
        self.write({"event": name, "step": step, **fields})

    def truncate_after(self, step: int) -> None:
        """Drop this run's entries past ``step``: after a resume from checkpoint-``step``, lines a killed run
        wrote beyond its checkpoint describe steps that are about to run again. Earlier runs' lines (before
        the last fresh start) are kept as they are."""
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        entries = [_parse(line) for line in lines]
        start = last_fresh_start(entries)
        kept = lines[:start] + [
            line for line, e in zip(lines[start:], entries[start:]) if e is not None and int(e.get("step", 0)) <= step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")


def _parse(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # a line cut short by a kill
        return None


def last_fresh_start(entries: list[dict[str, Any] | None]) -> int:
    """Index of the last "train_begin" event of a run that did not resume (0 if none): where the current
    run's record begins when several runs appended to one file."""
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if e is not None and e.get("event") == "train_begin" and e.get("resumed_from") is None:
            return i
    return 0


def read_metrics(path: str | Path, current_run: bool = True) -> list[dict[str, Any]]:
    """The complete entries of a metrics.jsonl file (a line cut short by a kill is skipped); with
    ``current_run``, only those of the last run started fresh (and its resumes)."""
    entries = [_parse(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    if current_run:
        entries = entries[last_fresh_start(entries) :]
    return [e for e in entries if e is not None]


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLogger(TrainerCallback):
    """Numeric log values as TensorBoard scalars under ``logging_dir`` (tags "train/loss", "eval/loss", ...).

    torch.utils.tensorboard is imported here, lazily: it needs the optional ``tensorboard`` package.
    """

    def __init__(self, logging_dir: str | Path) -> None:
        if not tensorboard_available():
            raise ValueError(
                "report_to='tensorboard' needs the tensorboard package: pip install tensorboard "
                "(or use report_to='none'; metrics.jsonl is written either way)"
            )
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logging_dir))

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, value in (logs or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
            self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.writer.close()
