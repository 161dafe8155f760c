"""The drop-in promise at the Trainer level: hf_dropin_script.py runs with transformers, and with only its
import line changed to mixprec, and both report to MLflow, checkpoint activations, read a stream, stop early
and restore the best model."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
mlflow = pytest.importorskip("mlflow")

SCRIPT = Path(__file__).with_name("hf_dropin_script.py")
HF_LINE = "from transformers import EarlyStoppingCallback, Trainer, TrainingArguments"


def load_script(library: str) -> types.ModuleType:
    source = SCRIPT.read_text()
    assert source.count(HF_LINE) == 1
    if library == "mixprec":
        source = source.replace(HF_LINE, "from mixprec import EarlyStoppingCallback, Trainer, TrainingArguments")
    module = types.ModuleType(f"dropin_{library}")
    exec(compile(source, str(SCRIPT), "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("library", ["mixprec", pytest.param("transformers", marks=pytest.mark.slow)])
def test_the_script_runs_with_only_the_import_changed(tmp_path, monkeypatch, library):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "dropin")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = load_script(library).main(str(tmp_path / "out"))
    finally:
        torch.set_num_threads(n)
    state = trainer.state
    assert 3 <= state.global_step <= 12 and state.best_model_checkpoint is not None
    assert trainer.model.is_gradient_checkpointing
    assert [e for e in state.log_history if "eval_loss" in e]
    client = mlflow.tracking.MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("dropin").experiment_id])[0]
    assert run.info.run_name == "drop-in"
    assert client.get_metric_history(run.info.run_id, "loss")
