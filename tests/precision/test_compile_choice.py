"""The rule behind "compile where it pays" (mixprec.precision.compile_choice): figures in, verdict and sentence out."""

from __future__ import annotations

from mixprec.precision.compile_choice import NOT_KEPT, SKIPPED, CompileFigures, compile_pays
from mixprec.precision.decision import AutoDecision


def test_compiling_pays_only_when_the_gain_over_the_steps_left_beats_the_compile_time():
    # the main job's shape on a 2-core CPU: a 1.3 ms gain on a 30 ms step cannot win back 21 s in 280 steps
    assert not compile_pays(eager_step_s=0.0301, compiled_step_s=0.0288, compile_s=21.0, steps_left=280)
    # the same gain pays over a run 100x longer: 1.3 ms x 28,000 steps = 36 s > 21 s
    assert compile_pays(eager_step_s=0.0301, compiled_step_s=0.0288, compile_s=21.0, steps_left=28_000)
    # a compiled step slower than the eager one never pays, however long the run
    assert not compile_pays(eager_step_s=0.030, compiled_step_s=0.031, compile_s=0.001, steps_left=10**9)
    # no compiled step timed yet: even a step of no time at all (the whole eager step saved) must pay
    assert not compile_pays(eager_step_s=0.030, compiled_step_s=None, compile_s=21.0, steps_left=600)
    assert compile_pays(eager_step_s=0.030, compiled_step_s=None, compile_s=21.0, steps_left=800)


def test_the_verdict_says_why_in_figures():
    figures = CompileFigures(NOT_KEPT, eager_step_s=0.0301, compiled_step_s=0.0288, compile_s=21.0, steps_left=280)
    text = figures.explain()
    assert text.startswith("compile: not kept: 1.3 ms/step gain x 280 steps = 0.36 s < 21.0 s to compile")
    assert "eager 30.1 ms a step, compiled 28.8 ms" in text
    # an earlier run's figures judged against this run's length: skipped, naming where they came from
    cached = CompileFigures(SKIPPED, 0.0301, 0.0288, 21.0, steps_left=60, source="cache")
    assert cached.explain().startswith("compile: skipped: the cache's figures")
    assert "1.3 ms/step gain x 60 steps = 0.08 s < 21.0 s to compile" in cached.explain()
    assert cached.cannot_pay(60) and not cached.cannot_pay(60_000)


def test_auto_decision_carries_the_compile_verdict_into_its_explanation_and_back():
    figures = CompileFigures(NOT_KEPT, 0.0301, None, 21.0, steps_left=5)
    decision = AutoDecision("fp32", {"fp32": 0.03}, compile=figures.to_dict())
    assert "compile: not kept: at most 30.1 ms/step (a whole eager step) x 5 steps" in decision.explain()
    again = AutoDecision.from_dict(decision.to_dict())  # as a checkpoint or the cache keeps it
    assert CompileFigures.from_dict(again.compile) == figures
