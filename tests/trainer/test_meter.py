"""trainer.meter: running losses without host syncs; a skipped step's inf/NaN loss is left out of the means
(HF's logging_nan_inf_filter), so one overflow does not turn every later logged mean into nan."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.trainer.meter import StepMeter


def _meter(**kwargs) -> StepMeter:
    return StepMeter(lambda: 1.0, **kwargs)


def test_non_finite_losses_are_left_out_of_the_window_and_the_run_mean():
    m = _meter()
    for loss in (1.0, float("inf"), 3.0):
        m.add(torch.tensor(loss), samples=1, tokens=0)
    assert m.take_window() == (pytest.approx(2.0), 1)  # the mean, and how many losses were left out
    m.add(torch.tensor(float("nan")), samples=1, tokens=0)
    assert m.take_window() == (pytest.approx(2.0), 1)  # a window of skipped steps only: the run's mean so far
    m.add(torch.tensor(5.0), samples=1, tokens=0)
    assert m.mean_loss() == pytest.approx(3.0)  # (1 + 3 + 5) / 3


def test_a_first_window_of_skipped_steps_only_logs_a_finite_stand_in_marked_as_filtered():
    # HF's filter keeps inf/NaN out of the logs: before any finite loss its arithmetic gives 0.0; the count of
    # filtered losses goes with it, and the run's mean stays nan (no loss was measured)
    m = _meter()
    m.add(torch.tensor(float("nan")), samples=1, tokens=0)
    m.add(torch.tensor(float("inf")), samples=1, tokens=0)
    assert m.take_window() == (0.0, 2)
    assert math.isnan(m.mean_loss())


def test_without_the_filter_the_loss_is_logged_as_it_is():
    m = _meter(nan_inf_filter=False)
    m.add(torch.tensor(1.0), samples=1, tokens=0)
    m.add(torch.tensor(float("inf")), samples=1, tokens=0)
    assert m.take_window() == (math.inf, 0)


def test_the_open_window_survives_a_checkpoint():
    m = _meter()
    for loss in (1.0, float("inf"), 3.0):
        m.add(torch.tensor(loss), samples=1, tokens=0)
    again = _meter()
    again.load_state_dict(m.state_dict(), torch.device("cpu"))
    assert again.take_window() == (pytest.approx(2.0), 1)


def test_a_resumed_runs_mean_loss_is_over_its_own_steps():
    # issue 34: a resumed 10-step run printed the uninterrupted 20-step mean as "the mean over the 10 steps
    # this run took"; the logged windows still continue the whole run's
    m = _meter()
    for loss in (10.0, 20.0):
        m.add(torch.tensor(loss), samples=1, tokens=0)
    m.take_window()
    m.add(torch.tensor(30.0), samples=1, tokens=0)  # left in the open window at the checkpoint
    resumed = _meter()
    resumed.load_state_dict(m.state_dict(), torch.device("cpu"))
    for loss in (1.0, 3.0):
        resumed.add(torch.tensor(loss), samples=1, tokens=0)
    assert resumed.take_window() == (pytest.approx(34.0 / 3), 0)  # the window the checkpoint cut, whole
    assert resumed.mean_loss() == pytest.approx(2.0)  # (1 + 3) / 2: this run's steps only


def test_a_resumed_trainers_train_loss_is_the_mean_of_the_steps_it_took(tmp_path, one_thread):
    from mixprec import Trainer, TrainingArguments
    from trainer_utils import make_examples, make_model

    def args(out, **kw):
        return TrainingArguments(
            output_dir=str(tmp_path / out),
            disable_tqdm=True,
            save_plots=False,
            logging_steps=1,
            learning_rate=1e-2,
            per_device_train_batch_size=4,
            max_steps=6,
            precision="fp32",
            **kw,
        )

    full = Trainer(make_model(), args("full", save_steps=2), train_dataset=make_examples(20))
    full.train()
    resumed = Trainer(make_model(seed=1), args("resumed", save_strategy="no"), train_dataset=make_examples(20))
    output = resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    losses = {e["step"]: e["loss"] for e in full.state.log_history if "loss" in e}  # one step per log entry
    assert output.metrics["train_loss_steps"] == 2
    assert output.training_loss == pytest.approx((losses[5] + losses[6]) / 2, rel=1e-6)
    assert full.state.log_history[-1]["train_loss"] == pytest.approx(sum(losses.values()) / 6, rel=1e-6)
