"""Experiment trackers: TensorBoard, MLflow and Weights & Biases behind one small interface.

accelerate's contract (``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``get_tracker``,
``end_training``) is built on them, and so are the Trainer's ``report_to`` loggers. Each package is optional
and imported only when its tracker is made; :func:`require` (called where the names are given, so a missing
package fails before any work) raises a ValueError that says what to install.

A tracker: ``store_init_configuration(config)`` (the run's hyperparameters), ``log(values, step, **kwargs)``
(the keyword arguments go to the package's own call), ``finish()``; ``tracker`` is the underlying object (a
SummaryWriter, the mlflow module, the wandb run).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger("mixprec.accelerator")

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Tracker name -> the module it needs (pip package of the same name)."""


def require(name: str, argument: str) -> None:
    """A ValueError naming ``argument`` and what to install, when tracker ``name``'s package is missing."""
    if importlib.util.find_spec(PACKAGES[name]) is None:
        raise ValueError(
            f"{argument}={name!r} needs the {PACKAGES[name]} package: pip install {PACKAGES[name]} "
            f"(or leave {name!r} out)"
        )


def installed() -> list[str]:
    """The trackers whose packages are installed ("all")."""
    return [name for name, module in PACKAGES.items() if importlib.util.find_spec(module) is not None]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        value = value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else None
    return float(value) if isinstance(value, (int, float)) else None


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


class TensorBoardTracker:
    """Scalars (and text for strings) under ``logging_dir`` (``torch.utils.tensorboard``)."""

    name = "tensorboard"

    def __init__(self, logging_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = Path(logging_dir)
        self.writer = SummaryWriter(log_dir=str(self.logging_dir))

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        self.writer.add_hparams({k: v for k, v in config.items() if _plain(v) and v is not None}, metric_dict={})
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            number = _number(value)
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class MLflowTracker:
    """A run in MLflow's tracking store (MLFLOW_TRACKING_URI, as MLflow reads it). An active run the script
    opened is used and left open; a run this tracker started is ended by :meth:`finish`."""

    name = "mlflow"

    def __init__(self, experiment_name: str | None = None, run_name: str | None = None, **start_kwargs: Any) -> None:
        import mlflow

        self.mlflow = mlflow
        self.started = False
        if mlflow.active_run() is None:
            choose_mlflow_store(mlflow)
            if experiment_name:
                mlflow.set_experiment(experiment_name)
            mlflow.start_run(run_name=run_name, **start_kwargs)
            self.started = True

    @property
    def tracker(self) -> Any:
        return self.mlflow

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        # MLflow caps a parameter's length (long lists are cut, as HF does) and takes 100 per call
        params = {k: str(v)[:250] for k, v in config.items()}
        names = list(params)
        for i in range(0, len(names), 100):
            self.mlflow.log_params({k: params[k] for k in names[i : i + 100]})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers = {k: _number(v) for k, v in values.items()}
        metrics = {k: v for k, v in numbers.items() if v is not None and math.isfinite(v)}
        if metrics:
            self.mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        if self.started and self.mlflow.active_run() is not None:
            self.mlflow.end_run()
        self.started = False


def choose_mlflow_store(mlflow: Any) -> None:
    """A tracking store MLflow can open, or a one-line ValueError saying what to install or set.

    MLflow 3 defaults to a SQLite store (``./mlflow.db``), which needs SQLAlchemy; mlflow-skinny (mixprec's
    ``mlflow`` extra) lacks it, and its first call dies in a traceback about the model registry (issue 22). So
    with no tracking URI set and no SQLAlchemy, runs go to the file store ``./mlruns`` (MLflow 2's default;
    ``mlflow ui`` in that folder reads it), opting into it as MLflow asks (``MLFLOW_ALLOW_FILE_STORE=true``),
    and a warning says so. A URI the user set is used as set, or refused with the fix."""
    has_sqlalchemy = importlib.util.find_spec("sqlalchemy") is not None
    uri = str(mlflow.get_tracking_uri())
    scheme = urlparse(uri).scheme
    if not mlflow.is_tracking_uri_set():
        if (scheme == "sqlite" and not has_sqlalchemy) or scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(Path("mlruns").resolve().as_uri())
            logger.warning(
                "mlflow: no MLFLOW_TRACKING_URI set and mlflow-skinny cannot open MLflow's default SQLite store: "
                "logging to %s (set MLFLOW_TRACKING_URI to choose)",
                mlflow.get_tracking_uri(),
            )
        return
    if scheme == "sqlite" and not has_sqlalchemy:
        raise ValueError(
            f"mlflow: MLFLOW_TRACKING_URI={uri} needs SQLAlchemy, which mlflow-skinny lacks: pip install mlflow "
            "(or set MLFLOW_TRACKING_URI=file:./mlruns and MLFLOW_ALLOW_FILE_STORE=true)"
        )
    if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise ValueError(
            f"mlflow: MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 opens only with "
            "MLFLOW_ALLOW_FILE_STORE=true: set it (or use a server or sqlite URI)"
        )


class WandbTracker:
    """A Weights & Biases run (WANDB_MODE=offline writes it under ``dir`` without a network). An active run is
    used and left open; a run this tracker started is finished by :meth:`finish`."""

    name = "wandb"

    def __init__(self, project: str, run_name: str | None = None, **init_kwargs: Any) -> None:
        import wandb

        self.wandb = wandb
        self.started = None
        if wandb.run is None:
            self.started = wandb.init(project=project, name=run_name, **init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.wandb.run

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        plain = {k: v for k, v in config.items() if _plain(v) or isinstance(v, (list, tuple, dict))}
        self.wandb.run.config.update(plain, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self.wandb.run is not None:
            self.wandb.log(values, step=step, **kwargs)

    def finish(self) -> None:
        if self.started is not None:
            self.started.finish()
            self.started = None


def make_tracker(name: str, project_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> Any:
    """accelerate's tracker for ``name``: TensorBoard writes under ``logging_dir/project_name``, MLflow uses
    ``project_name`` as the experiment, W&B as the project. ``kwargs`` go to the tracker (accelerate's
    ``init_kwargs[name]``)."""
    if name == "tensorboard":
        return TensorBoardTracker(Path(logging_dir) / project_name)
    if name == "mlflow":
        return MLflowTracker(experiment_name=project_name, **kwargs)
    if name == "wandb":
        return WandbTracker(project=project_name, **kwargs)
    raise ValueError(f"unknown tracker {name!r}: choose from {', '.join(PACKAGES)}")


class Trackers:
    """The Accelerator's trackers part (accelerate's ``log_with``, and its method names: the Accelerator
    delegates ``init_trackers``, ``log``, ``get_tracker`` and ``trackers`` here): made by ``init_trackers`` on
    the main process only (elsewhere every call is a no-op, as accelerate), finished by ``end_training``."""

    def __init__(self, log_with: Any, logging_dir: Any, is_main: bool) -> None:
        self.names = resolve_log_with(log_with)
        self.logging_dir = logging_dir
        self.is_main = is_main
        self.active: list[Any] = []

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Start the ``log_with`` trackers on the main process: TensorBoard under ``logging_dir/project_name``,
        MLflow's experiment or W&B's project named ``project_name``; ``config`` is stored as the run's
        hyperparameters; ``init_kwargs={"wandb": {...}}`` goes to that tracker."""
        if not self.is_main:
            return
        if self.names and self.logging_dir is None and "tensorboard" in self.names:
            raise ValueError(
                "Accelerator(log_with='tensorboard') writes under the project's logging_dir: pass "
                "Accelerator(project_dir=...) (or a ProjectConfiguration with logging_dir)"
            )
        kwargs = init_kwargs or {}
        self.active = [make_tracker(n, project_name, self.logging_dir or ".", **kwargs.get(n, {})) for n in self.names]
        if config is not None:
            for tracker in self.active:
                tracker.store_init_configuration(dict(config))

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        for tracker in self.active:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker ``name`` ("tensorboard", "mlflow", "wandb"), or with ``unwrap`` what it wraps (the
        SummaryWriter, the mlflow module, the wandb run)."""
        for tracker in self.active:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main:
            return None  # accelerate: the other processes hold no trackers
        raise ValueError(f"get_tracker({name!r}): no such tracker was initialised (log_with={self.names})")

    @property
    def trackers(self) -> list[Any]:
        """The experiment trackers started by init_trackers (log_with), in order."""
        return list(self.active)

    def finish(self) -> None:
        for tracker in self.active:
            tracker.finish()
        self.active = []


def resolve_log_with(log_with: Any) -> list[str]:
    """accelerate's ``log_with`` (a name, a list of names, "all", None) as tracker names; an unknown name or a
    missing package is refused, naming the argument."""
    names = [log_with] if isinstance(log_with, str) else list(log_with or [])
    if "all" in names:
        return installed()
    for name in names:
        if name not in PACKAGES:
            raise ValueError(
                f"Accelerator(log_with={log_with!r}): unknown tracker {name!r}; choose from "
                f"{', '.join(PACKAGES)} or 'all'"
            )
        require(name, "Accelerator(log_with)")
    return names
