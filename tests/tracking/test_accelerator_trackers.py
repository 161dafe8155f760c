"""accelerate's experiment tracking on the Accelerator: ``log_with``, ``init_trackers``, ``log``,
``get_tracker``, ``end_training`` (TensorBoard, MLflow against a local store, W&B offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec import Accelerator


def test_tensorboard_gets_the_config_scalars_and_text_under_the_project(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(cpu=True, verbose=False, log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("proj", config={"lr": 0.1, "layers": 2, "name": "tiny"})
    for step, loss in enumerate([2.0, 1.5, 1.25]):
        acc.log({"train_loss": loss, "note": "ok"}, step=step)
    writer = acc.get_tracker("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter" and acc.trackers[0].name == "tensorboard"
    acc.end_training()
    events = [p for p in (tmp_path / "proj").iterdir() if p.name.startswith("events.")]
    scalars = EventAccumulator(str(events[0])).Reload().Scalars("train_loss")
    assert [(s.step, s.value) for s in scalars] == [(0, 2.0), (1, 1.5), (2, 1.25)]
    assert not acc.trackers  # finished by end_training


def test_mlflow_experiment_is_the_project_with_params_and_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    acc = Accelerator(cpu=True, verbose=False, log_with=["mlflow"])
    acc.init_trackers("acc-proj", config={"lr": 0.1}, init_kwargs={"mlflow": {"run_name": "first"}})
    acc.log({"loss": 1.0}, step=1)
    acc.log({"loss": 0.5, "nan": float("nan")}, step=2)  # a non-finite value is left out, not an error
    acc.end_training()
    client = mlflow.tracking.MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("acc-proj").experiment_id])[0]
    assert run.info.run_name == "first" and run.info.status == "FINISHED" and run.data.params["lr"] == "0.1"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 1.0), (2, 0.5)]


@pytest.fixture
def mlflow_defaults(tmp_path, monkeypatch):
    """MLflow as a new user has it: no tracking URI, no file-store opt-in, the working folder tmp_path."""
    mlflow = pytest.importorskip("mlflow")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch restores what was there before
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(None)
    # A fresh process has no active experiment; an earlier test's set_experiment would name one of its store.
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    yield mlflow
    mlflow.set_tracking_uri(None)  # the fallback set it process-wide


def test_report_to_mlflow_with_default_settings_logs_to_a_local_file_store(mlflow_defaults, tmp_path, caplog):
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("with SQLAlchemy (the full mlflow package) MLflow's default SQLite store opens as it is")
    from mixprec import Trainer, TrainingArguments
    from trainer_utils import make_examples, make_model

    args = TrainingArguments(str(tmp_path / "out"), max_steps=2, logging_steps=1, report_to="mlflow", disable_tqdm=True)
    Trainer(make_model(), args, train_dataset=make_examples(8)).train()  # a traceback from mlflow-skinny before
    assert "logging to file://" in caplog.text and "set MLFLOW_TRACKING_URI to choose" in caplog.text
    client = mlflow_defaults.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]


def test_mlflow_uri_it_cannot_open_is_refused_in_one_line(mlflow_defaults, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
        acc = Accelerator(cpu=True, verbose=False, log_with="mlflow")
        with pytest.raises(ValueError, match=r"needs SQLAlchemy, which mlflow-skinny lacks: pip install mlflow"):
            acc.init_trackers("proj")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    acc = Accelerator(cpu=True, verbose=False, log_with="mlflow")
    with pytest.raises(ValueError, match=r"is a file store, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE"):
        acc.init_trackers("proj")


def test_wandb_offline_writes_a_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    acc = Accelerator(cpu=True, verbose=False, log_with="wandb")
    acc.init_trackers("acc-proj", config={"lr": 0.1}, init_kwargs={"wandb": {"dir": str(tmp_path)}})
    acc.log({"loss": 1.0}, step=0)
    assert acc.get_tracker("wandb", unwrap=True).config["lr"] == 0.1
    acc.end_training()
    assert list(Path(tmp_path, "wandb").glob("offline-run-*"))


def test_bad_tracker_settings_are_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"Accelerator\(log_with='comet'\): unknown tracker"):
        Accelerator(cpu=True, verbose=False, log_with="comet")
    acc = Accelerator(cpu=True, verbose=False, log_with="tensorboard")
    with pytest.raises(ValueError, match="project_dir"):
        acc.init_trackers("proj")  # TensorBoard needs a folder to write in
    with pytest.raises(ValueError, match=r"get_tracker\('mlflow'\)"):
        acc.get_tracker("mlflow")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="pip install wandb"):
        Accelerator(cpu=True, verbose=False, log_with="wandb")


def test_without_log_with_logging_is_a_no_op(tmp_path):
    acc = Accelerator(cpu=True, verbose=False)
    acc.init_trackers("proj", config={"lr": 0.1})
    acc.log({"loss": 1.0}, step=0)
    assert acc.trackers == [] and not any(tmp_path.iterdir())
