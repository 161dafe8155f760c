"""trainer.meter: running losses without host syncs; a skipped step's inf/NaN loss is left out of the means
(HF's logging_nan_inf_filter), so one overflow does not turn every later logged mean into nan."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.trainer.meter import StepMeter


def _meter(**kwargs) -> StepMeter:
    return StepMeter(lambda: 0.0, lambda: 1.0, **kwargs)


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
