"""bench.timing: the step clock and the median/spread every benchmark row reports."""

from __future__ import annotations

import time

import pytest
import torch

from mixprec.bench.timing import CpuTimer, make_timer, summarize


def test_cpu_timer_measures_the_interval_not_less():
    timer = CpuTimer()
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    times = timer.times()
    assert len(times) == 2
    assert all(t >= 0.01 for t in times)


def test_stop_before_start_names_the_mistake():
    with pytest.raises(RuntimeError, match="before start"):
        CpuTimer().stop()


def test_make_timer_uses_perf_counter_on_cpu():
    assert isinstance(make_timer(torch.device("cpu")), CpuTimer)


def test_summary_is_the_median_with_the_interquartile_range():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s.median == 3.0
    assert (s.q1, s.q3) == (2.0, 4.0)
    assert s.spread == 2.0
    assert (s.minimum, s.maximum, s.count) == (1.0, 5.0, 5)


def test_one_outlier_moves_neither_median_nor_spread_much():
    steady = summarize([1.0] * 8)
    noisy = summarize([1.0] * 7 + [50.0])  # a neighbour's job stalled one step
    assert noisy.median == steady.median == 1.0
    assert noisy.spread == 0.0
    assert noisy.maximum == 50.0


def test_a_single_time_has_zero_spread_and_empty_is_refused():
    s = summarize([0.5])
    assert (s.median, s.spread, s.count) == (0.5, 0.0, 1)
    with pytest.raises(ValueError):
        summarize([])
