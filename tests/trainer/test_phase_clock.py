"""Where a run's time goes (issue 36): the summary's split of the run and of the step."""

from __future__ import annotations

import time

import mixprec.trainer.phase_clock as phase_clock
from mixprec import Trainer, TrainingArguments
from mixprec.trainer.phase_clock import STEP_PHASES, PhaseClock
from trainer_utils import make_examples, make_model


def test_compile_time_is_reported_apart_and_taken_out_of_the_step(monkeypatch):
    """--compile spent its compile inside the first steps: the summary said the steps were 2x slower. The
    compile is its own figure now, and forward+backward is the compiled step's."""
    compiled = [0.0]
    monkeypatch.setattr(phase_clock, "compile_seconds", lambda: compiled[0])
    clock = PhaseClock()
    clock.seconds["forward_backward"] = 12.0  # 10 steps: 1.0 s each, 10 s of which was the first step's compile
    clock.seconds["optimizer"] = 0.5
    compiled[0] = 10.0
    out = clock.breakdown(runtime=13.0, steps=10, race_seconds=0.0)
    assert out["run_seconds"]["compile"] == 10.0
    assert out["run_seconds"]["training_steps"] == 3.0
    assert out["step_ms"]["forward_backward"] == 200.0 and out["step_ms"]["optimizer"] == 50.0
    assert out["step_ms"]["other"] == 50.0  # the 0.5 s no phase claimed


def test_a_trainer_run_says_where_its_time_went(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(48), eval_dataset=make_examples(16))
    start = time.perf_counter()
    summary = trainer.train().metrics
    wall = time.perf_counter() - start
    split, step = summary["time"]["run_seconds"], summary["time"]["step_ms"]
    assert set(step) == {*STEP_PHASES, "other"} and all(v >= 0 for v in step.values())
    assert split["evaluation"] > 0 and split["save"] > 0 and split["compile"] == 0.0
    parts = split["training_steps"] + split["evaluation"] + split["save"]
    assert abs(parts - summary["train_runtime"]) < 0.01 and summary["train_runtime"] <= wall
    # the step's phases add up to the training steps' time (ms per step x steps)
    assert abs(sum(step.values()) * 6 / 1000 - split["training_steps"]) < 0.01
    overhead = summary["time"]["host_overhead_ms_per_step"]
    assert abs(overhead - (step["data"] + step["callbacks_logging"] + step["other"])) < 0.01
