"""mixprec.trainer.hf_loggers: the Trainer's HF-shaped messages are where HF scripts and tests look for them."""

from __future__ import annotations

import logging
import sys
from unittest.mock import patch

import pytest

from mixprec import Trainer, TrainerCallback, TrainingArguments
from mixprec.trainer import hf_loggers
from trainer_utils import captured_records, make_examples, make_model

needs_transformers = pytest.mark.skipif(not hf_loggers.transformers_installed(), reason="transformers not installed")


class Twice(TrainerCallback):
    pass


@pytest.fixture
def restore_levels():
    loggers = [logging.getLogger(name) for name in ("mixprec", "transformers")]
    levels = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        max_steps=1,
        per_device_train_batch_size=2,
        **kwargs,
    )


@needs_transformers
def test_a_duplicate_callback_warning_reaches_a_patched_transformers_trainer_callback_logger(tmp_path):
    # HF's test_trainer_callback does exactly this, and reads the class's str() from the first argument.
    with patch("transformers.trainer_callback.logger.warning") as warn:
        Trainer(make_model(), args(tmp_path), train_dataset=make_examples(4), callbacks=[Twice, Twice])
    assert str(Twice) in warn.call_args[0][0]


@needs_transformers
def test_the_running_training_banner_is_on_transformers_logger_and_follows_log_level(tmp_path, restore_levels):
    hf_root = logging.getLogger("transformers")  # what transformers.utils.logging.get_logger() returns
    for level, shown in (("info", True), ("debug", True), ("error", False)):
        with captured_records(hf_root) as records:
            Trainer(make_model(), args(tmp_path, log_level=level), train_dataset=make_examples(4)).train()
        text = "\n".join(r.getMessage() for r in records)
        assert ("***** Running training *****" in text) is shown, level
        if shown:
            assert "Total optimization steps = 1" in text and "Num examples = 4" in text
        assert hf_root.level == logging.getLevelName(level.upper())


def test_without_transformers_the_messages_stay_on_mixprecs_logger(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_loggers, "transformers_installed", lambda: False)
    imported = "transformers" in sys.modules
    with captured_records(logging.getLogger("mixprec.trainer")) as records:
        Trainer(make_model(), args(tmp_path), train_dataset=make_examples(4), callbacks=[Twice, Twice])
    assert any("Twice" in r.getMessage() for r in records)
    assert ("transformers" in sys.modules) == imported  # routing the messages imported nothing
