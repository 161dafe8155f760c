"""Where logs go: ``metrics.jsonl`` always; TensorBoard, MLflow and Weights & Biases when ``report_to`` asks
(each an optional package, imported only when asked for; :func:`make_reporters` builds them).

The reporters are callbacks on ``on_log`` and run on the main process only (the Trainer adds them there).
The JSONL file is written by the run's events, not by a callback a user could remove. It is the run's
complete record: training and evaluation entries (the same dicts as ``state.log_history``) plus events the
history does not hold: the start of each run (and of each resume), each skipped step with the parameters
whose gradients were non-finite, and each change of the loss scale. The file is appended to, so several runs
in one output_dir follow each other; the plots are drawn from the latest.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from mixprec import tree as pytree
from mixprec.tracking.trackers import MLflowTracker, TensorBoardTracker, WandbTracker, require
from mixprec.trainer.callbacks import TrainerCallback

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    def leaf(x: Any) -> Any:
        if hasattr(x, "item") and callable(x.item):  # a 0-dim tensor or numpy scalar
            x = x.item()
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)  # "inf"/"nan": strict JSON has no literal for them
        return x

    return pytree.tree_map(leaf, value)


class JsonlLogger:
    """Appends one JSON object per line to ``<output_dir>/metrics.jsonl`` and flushes it at once, so a
    killed run's file is complete up to its last line."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, entry: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **entry}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")

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
    return importlib.util.find_spec("tensorboard") is not None


def _numeric(logs: dict[str, Any] | None) -> dict[str, float]:
    return {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _split_tag(key: str) -> str:
    """HF's reporters' names: "eval_loss" -> "eval/loss", "loss" -> "train/loss"."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class _Reporter(TrainerCallback):
    """A ``report_to`` logger: its tracker (made when training begins, or given) is finished when it ends."""

    tracker: Any = None

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.finish()


class MLflowLogger(_Reporter):
    """Parameters (the TrainingArguments) and numeric logs to MLflow, as HF's MLflowCallback: the tracking
    URI and experiment come from MLflow's own environment variables (MLFLOW_TRACKING_URI,
    MLFLOW_EXPERIMENT_NAME); the run is named ``args.run_name`` and ended at the end of training if this
    logger started it (an active run the script opened is used and left open)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.tracker = MLflowTracker(os.environ.get("MLFLOW_EXPERIMENT_NAME"), run_name=args.run_name)
        self.tracker.store_init_configuration(args.to_dict())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.tracker is not None:
            self.tracker.log({k.replace("/", "_"): v for k, v in _numeric(logs).items()}, step=state.global_step)


class WandbLogger(_Reporter):
    """Numeric logs to Weights & Biases (``train/loss``, ``eval/loss``, ... as HF's WandbCallback), with the
    TrainingArguments as the run config. WANDB_MODE=offline writes the run under ./wandb without a network;
    WANDB_PROJECT names the project (default "huggingface", HF's)."""

    def on_train_begin(self, args, state, control, **kwargs):
        project = os.environ.get("WANDB_PROJECT", "huggingface")
        self.tracker = WandbTracker(project, run_name=args.run_name, dir=args.output_dir)
        self.tracker.store_init_configuration(args.to_dict())

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = {_split_tag(k): v for k, v in _numeric(logs).items()}
        if metrics and self.tracker is not None:
            self.tracker.log({**metrics, "train/global_step": state.global_step})


def make_reporters(report_to: list[str], logging_dir: str | Path) -> list[TrainerCallback]:
    """The loggers ``report_to`` names, each raising a ValueError that says what to install when its package
    is missing. Call it before joining a process group, so a missing package fails fast."""
    factories = {
        "tensorboard": lambda: TensorBoardLogger(logging_dir),
        "mlflow": MLflowLogger,
        "wandb": WandbLogger,
    }
    for name in report_to:
        if name == "tensorboard" and not tensorboard_available():
            raise ValueError(
                "report_to='tensorboard' needs the tensorboard package: pip install tensorboard "
                "(or leave it out of report_to; metrics.jsonl is written either way)"
            )
        require(name, "report_to")
    return [factories[name]() for name in report_to]


class TensorBoardLogger(_Reporter):
    """Numeric log values as TensorBoard scalars under ``logging_dir`` (tags "train/loss", "eval/loss", ...)."""

    def __init__(self, logging_dir: str | Path) -> None:
        self.tracker = TensorBoardTracker(logging_dir)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.tracker.log({_split_tag(k): v for k, v in _numeric(logs).items()}, step=state.global_step)
