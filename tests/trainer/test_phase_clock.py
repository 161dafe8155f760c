"""Where a run's time goes (issue 36): the summary's split of the run and of the step."""

from __future__ import annotations

import time

import mixprec.trainer.phase_clock as phase_clock
from mixprec import Trainer, TrainingArguments
from mixprec.trainer.phase_clock import STEP_PHASES, PhaseClock
from trainer_utils import make_examples, make_model


def test_compile_time_is_reported_apart_and_taken_out_of_the_step(monkeypatch):
    """--compile spent its compile inside the first steps: the summary said the steps were 2x slower. The
    compile is its own figure now, and forward and backward are the compiled step's."""
    compiled = [0.0]
    monkeypatch.setattr(phase_clock, "compile_seconds", lambda: compiled[0])
    clock = PhaseClock()
    # 10 steps: forward 0.1 s and backward 0.05 s each, and the first step's compile, 8 s and 2 s of them
    compiled[0] = 8.0
    clock.lap("forward")
    compiled[0] = 10.0
    clock.lap("backward")
    clock.seconds["forward"], clock.seconds["backward"] = 9.0, 2.5
    clock.seconds["optimizer"] = 0.5
    out = clock.breakdown(runtime=13.0, steps=10, race_seconds=0.0)
    assert out["run_seconds"]["compile"] == 10.0
    assert out["run_seconds"]["training_steps"] == 3.0
    assert out["step_ms"]["forward"] == 100.0 and out["step_ms"]["backward"] == 50.0
    assert out["step_ms"]["optimizer"] == 50.0
    assert out["step_ms"]["other"] == 100.0  # the 1.0 s no phase claimed
    assert "forward_backward" not in out["step_ms"]  # every micro-batch was split


def test_an_evaluations_compile_is_taken_out_of_the_evaluation_not_the_training_steps(monkeypatch):
    """--compile on the tiny GPT: its first evaluation compiled again (5.3 s of 26.3 s), and the summary took
    all of it out of the training steps: forward+backward 0.00 ms, training steps 0.0 s."""
    compiled = [0.0]
    monkeypatch.setattr(phase_clock, "compile_seconds", lambda: compiled[0])
    clock = PhaseClock()
    compiled[0] = 4.0
    clock.lap("forward_backward")  # the first steps compiled for 4 s
    compiled[0] = 6.0
    clock.lap("evaluation")  # the evaluation for 2 s
    clock.seconds["forward_backward"] = 5.0  # 10 steps: 4 s of compile and 1 s of steps
    clock.seconds["evaluation"] = 2.5  # 2 s of compile and 0.5 s of evaluation
    out = clock.breakdown(runtime=7.5, steps=10, race_seconds=0.0)
    assert out["run_seconds"]["compile"] == 6.0
    assert out["run_seconds"]["evaluation"] == 0.5 and out["run_seconds"]["training_steps"] == 1.0
    assert out["step_ms"]["forward_backward"] == 100.0


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
    assert step["forward"] > 0 and step["backward"] > 0  # told apart by the lap inside training_step
    assert split["evaluation"] > 0 and split["save"] > 0 and split["compile"] == 0.0
    parts = split["training_steps"] + split["evaluation"] + split["save"]
    assert abs(parts - summary["train_runtime"]) < 0.01 and summary["train_runtime"] <= wall
    # the step's phases add up to the training steps' time (ms per step x steps)
    assert abs(sum(step.values()) * 6 / 1000 - split["training_steps"]) < 0.01
    overhead = summary["time"]["host_overhead_ms_per_step"]
    assert abs(overhead - (step["data"] + step["callbacks_logging"] + step["other"])) < 0.01


def test_a_training_step_override_that_never_laps_stays_unsplit(tmp_path):
    """An override that calls ``accelerator.backward`` itself (HF's pattern) has no lap between its forward and
    its backward: its time is reported as one "forward_backward" figure, never as a backward with a free forward."""

    class Own(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
            loss = self.compute_loss(model, inputs)
            self.accelerator.backward(loss)
            return loss.detach()

    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", disable_tqdm=True, save_plots=False, max_steps=4, save_strategy="no"
    )
    out = Own(make_model(), args, train_dataset=make_examples(32)).train().metrics["time"]
    step = out["step_ms"]
    assert set(step) == {*STEP_PHASES, "forward_backward", "other"}
    assert step["forward"] == 0.0 and step["backward"] == 0.0 and step["forward_backward"] > 0
    assert abs(sum(step.values()) * 4 / 1000 - out["run_seconds"]["training_steps"]) < 0.01
