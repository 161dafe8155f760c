"""ScaleRecord: the per-step facts schedulers, loggers and EMA read instead of guessing whether a step ran."""

from __future__ import annotations

import json

import pytest

from mixprec.scaling.record import ScaleRecord, StepEntry


def test_counts_steps_skips_and_runs_of_skips():
    r = ScaleRecord(scale=8.0)
    for skipped, after in [(False, 8.0), (True, 4.0), (True, 2.0), (False, 2.0), (True, 1.0)]:
        r.add(r.scale, skipped, after)
    assert (r.steps, r.skipped_steps, r.applied_steps) == (5, 3, 2)
    assert r.last_step_skipped and r.consecutive_skips == 1  # the clean step in between reset the run
    assert r.scale == 1.0
    assert list(r.history) == [
        StepEntry(0, 8.0, False),
        StepEntry(1, 8.0, True),
        StepEntry(2, 4.0, True),
        StepEntry(3, 2.0, False),
        StepEntry(4, 2.0, True),
    ]


def test_history_is_bounded_but_counters_are_not():
    r = ScaleRecord(history_size=3)
    for i in range(10):
        r.add(1.0, i % 2 == 0, 1.0)
    assert [e.step for e in r.history] == [7, 8, 9]
    assert r.steps == 10 and r.skipped_steps == 5


def test_state_dict_is_json_and_round_trips():
    r = ScaleRecord(history_size=4, scale=2.0)
    for i in range(6):
        r.add(r.scale, i == 4, r.scale / 2 if i == 4 else r.scale)
    state = json.loads(json.dumps(r.state_dict()))
    back = ScaleRecord()
    back.load_state_dict(state)
    assert back == r
    assert back.history.maxlen == 4
    back.add(1.0, False, 1.0)
    assert len(back.history) == 4 and back.history[-1].step == 6


def test_history_size_must_be_positive():
    with pytest.raises(ValueError, match="history_size"):
        ScaleRecord(history_size=0)
