"""What a run has done so far (``TrainerState``) and what evaluation hands to ``compute_metrics``.

Both keep Hugging Face's field names, so callbacks and metric functions written for ``transformers`` work
unchanged. ``TrainerState`` is saved as JSON in every checkpoint (``trainer_state.json``, the file name HF
uses), never pickled.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mixprec.trainer.configs import resolve_steps
from mixprec.tree import strict_json

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """The run's progress and history. ``epoch`` is fractional (2.5 = halfway through the third epoch)."""

    epoch: float | None = None
    global_step: int = 0
    """Optimizer steps taken, skipped ones included (a skipped step still consumed its batches)."""
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, float]] = field(default_factory=list)
    """Every log entry in order: training entries carry "loss", "learning_rate", "loss_scale"; evaluation
    entries "eval_loss" and "eval_<metric>"; each has "step" and "epoch"."""
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    # Exactly HF's fields, so transformers.TrainerState.load_from_json reads our trainer_state.json. The count
    # of skipped steps lives in the loss scaler's record (saved with the scaler) and in each log entry.

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """``logging_steps``/``eval_steps``/``save_steps`` from ``args`` for a run of ``max_steps`` optimizer
        steps: an integer as it is, a float below 1 a ratio of the run, rounded up (HF's rule and name)."""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps", None)
            if value is not None:
                setattr(self, f"{kind}_steps", resolve_steps(value, max_steps))

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain data (HF's ``TrainerState`` has the same)."""
        return dataclasses.asdict(self)

    def save_to_json(self, json_path: str | Path) -> None:
        """Write the state as JSON (non-finite floats become null, so the file is strict JSON)."""
        text = json.dumps(strict_json(self.to_dict()), indent=2, sort_keys=True, allow_nan=False) + "\n"
        Path(json_path).write_text(text, encoding="utf-8")

    @classmethod
    def load_from_json(cls, json_path: str | Path) -> TrainerState:
        """Read a state written by :meth:`save_to_json` (or by HF's Trainer: unknown keys are ignored)."""
        values = json.loads(Path(json_path).read_text(encoding="utf-8"))
        if not isinstance(values, dict):
            raise ValueError(f"{json_path}: expected a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


class EvalPrediction:
    """Predictions and labels of a whole evaluation set, as numpy arrays.

    Unpacks as ``predictions, label_ids = eval_pred`` (HF's contract); with ``inputs`` or ``losses`` set it
    unpacks to three or four items in HF's order.
    """

    def __init__(
        self,
        predictions: np.ndarray | tuple[np.ndarray, ...],
        label_ids: np.ndarray | tuple[np.ndarray, ...] | None,
        inputs: np.ndarray | None = None,
        losses: np.ndarray | None = None,
    ) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        self._elements = tuple(x for x in (predictions, label_ids, inputs, losses) if x is not None)
        if inputs is None and losses is None:
            self._elements = (predictions, label_ids)

    def __iter__(self):
        return iter(self._elements)

    def __getitem__(self, index: int) -> Any:
        return self._elements[index]

    def __len__(self) -> int:
        return len(self._elements)

    def __repr__(self) -> str:
        shapes = [getattr(x, "shape", type(x).__name__) for x in self._elements]
        return f"EvalPrediction({', '.join(map(str, shapes))})"


class PredictionOutput(NamedTuple):
    """What :meth:`Trainer.predict` returns (HF's shape)."""

    predictions: np.ndarray | tuple[np.ndarray, ...]
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    metrics: dict[str, float] | None


class TrainOutput(NamedTuple):
    """What :meth:`Trainer.train` returns (HF's shape): the last step, the mean training loss, the summary."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]
