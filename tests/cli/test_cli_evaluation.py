"""cli/_evaluation.py: ``mixprec train`` evaluates at a larger batch than it trains at (no autograd), and reports
the same validation loss as at the training batch (issue 36)."""

from __future__ import annotations

import json

import pytest

from mixprec import Trainer, TrainingArguments
from mixprec.cli._evaluation import EVAL_BATCH_FACTOR, EVAL_BATCH_TOKENS, LOGITS_BYTES, LOGITS_SHARE, eval_batch_size
from mixprec.cli.main import main
from mixprec.trainer import trainer as trainer_module

pytestmark = pytest.mark.usefixtures("quick_train_cli")  # conftest.py: tmp_path as cwd, a short sample, one thread


def test_the_run_evaluates_at_a_larger_batch_and_reports_the_same_validation_loss(tmp_path, corpus, monkeypatch):
    """Three evaluations a run at the training batch cost the default job ~10% of its time (issue 36); a larger
    batch does the same work in fewer batches, and the validation loss the run reports must not change."""
    trained: list[Trainer] = []
    train = trainer_module.Trainer.train

    def keep(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        trained.append(self)
        return train(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train", keep)
    run = tmp_path / "run"
    flags = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--epoch-tokens", "256", "--epochs", "1"]
    assert main(["train", "--data", corpus, *flags, "--precision", "fp32", "--output-dir", str(run)]) == 0
    record = json.loads((run / "run.json").read_text())
    trainer = trained[0]
    windows = len(trainer.eval_dataset)
    # 4 training batches of 32-token windows are fewer tokens than EVAL_BATCH_TOKENS; the corpus holds fewer still
    batch = min(EVAL_BATCH_TOKENS // 32, windows)
    assert batch > 4 * EVAL_BATCH_FACTOR  # enough windows for the rule to show
    assert record["training_arguments"]["per_device_eval_batch_size"] == batch

    # the trained model, evaluated on the same windows at the training batch: the same figure
    model = trainer.accelerator.unwrap_model(trainer.model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "again"),
        precision="fp32",
        per_device_eval_batch_size=4,
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
        use_cpu=True,
    )
    again = Trainer(model, args, eval_dataset=trainer.eval_dataset).evaluate()["eval_loss"]
    assert record["eval_loss"] == pytest.approx(again, rel=1e-5)


def test_the_eval_batch_is_bounded_by_the_logits_memory_and_the_windows():
    per_window = 1024 * 50257 * LOGITS_BYTES  # GPT-2's logits of one 1024-token window, ~0.5 GB
    # a small vocabulary: EVAL_BATCH_FACTOR training batches, unless there are fewer windows to evaluate
    assert eval_batch_size(16, 128, 256, 512, 2**34) == 16 * EVAL_BATCH_FACTOR
    assert eval_batch_size(16, 128, 256, 40, 2**34) == 40
    # a training batch of few, short windows: EVAL_BATCH_TOKENS tokens a batch (not thousands of tiny forwards)
    assert eval_batch_size(1, 2, 256, 32_768, 2**34) == EVAL_BATCH_TOKENS // 2
    assert eval_batch_size(1, 1024, 256, 10_000, 2**34) == EVAL_BATCH_TOKENS // 1024
    # GPT-2 on an 80 GB GPU: as many windows as 1/8 of it holds logits for, never below the training batch
    fits = int(80e9 * LOGITS_SHARE) // per_window
    assert 16 < fits < 16 * EVAL_BATCH_FACTOR
    assert eval_batch_size(16, 1024, 50257, 10_000, int(80e9)) == fits
    assert eval_batch_size(16, 1024, 50257, 10_000, int(8e9)) == 16
    assert eval_batch_size(16, 1024, 50257, 10_000, None) == 16 * EVAL_BATCH_FACTOR  # memory unknown
