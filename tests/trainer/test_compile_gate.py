"""``torch_compile`` measured on the run's own steps, kept under "auto" only where it pays (trainer/compile_gate.py).

The runs compile with torch's "eager" backend: dynamo captures and times the graph as with inductor (its
counters are the compile's figure), without inductor's C++ builds, which take 20-70 s for a tiny model on this
2-core CPU. What is tested is what the Trainer does with the figures, not which backend produced them.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch._inductor.exc import InductorError

from mixprec import Trainer, TrainingArguments
from mixprec.precision import registry
from mixprec.precision.full import FullPrecision
from mixprec.trainer.phase_clock import compile_seconds
from trainer_utils import make_examples, make_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # dynamo's import and compile: seconds


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each run compiles afresh: dynamo reuses a graph compiled for another instance of the same model class
    (its compile then costs ~0 s, and no verdict would be safe to assert)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(tmp_path, name: str, steps: int, precision: str) -> tuple[Trainer, dict]:
    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
        max_steps=steps,
        precision=precision,
        torch_compile=True,
        torch_compile_backend="eager",
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(96))
    return trainer, trainer.train().metrics


def _compiled(trainer: Trainer) -> bool:
    return "_compiled_call_impl" in vars(trainer.model)  # what nn.Module.compile sets on the module


def _records(trainer: Trainer, event: str) -> list[dict]:
    lines = (trainer.events.metrics_path).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def test_a_short_auto_run_asked_to_compile_ends_eager_and_its_decision_says_why(tmp_path):
    # issue 36: --compile made a 300-step CPU run 2x slower, its compile never won back. 10 steps of a
    # 2 ms step cannot win back any compile: the run measures it, goes back to eager, and says so in figures.
    trainer, summary = _run(tmp_path, "short", steps=10, precision="auto")
    decision = trainer.accelerator.auto_decision
    assert decision.compile["verdict"] == "not kept" and decision.compile["source"] == "measured"
    assert decision.compile["compile_s"] > 0 and decision.compile["eager_step_s"] > 0
    assert "compile: not kept:" in decision.explain() and "s to compile" in decision.explain()
    assert "compile: not kept:" in trainer.accelerator.precision.reason  # the summary's precision line
    assert not _compiled(trainer)  # trains on eagerly after the verdict
    assert summary["compile"]["verdict"] == "not kept" and summary["auto_precision"]["compile"]["verdict"] == "not kept"
    assert summary["time"]["run_seconds"]["compile"] >= decision.compile["compile_s"] * 0.99
    [record] = _records(trainer, "compile")
    assert record["verdict"] == "not kept"


def test_a_second_run_skips_the_compile_its_cached_figures_say_cannot_pay(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_AUTO_CACHE", str(tmp_path / "auto.json"))
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "aside")  # decided on the first step: the gate reads the cache there
    # one candidate: a race run again (its cached decision re-checked off the noise) still chooses it
    monkeypatch.setattr(registry, "auto_candidates", lambda device: [FullPrecision(device)])
    first, _ = _run(tmp_path, "first", steps=10, precision="auto")
    assert first.accelerator.auto_decision.compile["verdict"] == "not kept"
    before = compile_seconds()
    second, summary = _run(tmp_path, "second", steps=12, precision="auto")
    figures = second.accelerator.auto_decision.compile
    assert figures["verdict"] == "skipped" and figures["source"] == "cache"
    assert figures["compile_s"] == first.accelerator.auto_decision.compile["compile_s"]
    assert "compile: skipped: the cache's figures" in second.accelerator.auto_decision.explain()
    assert compile_seconds() == before and not _compiled(second)  # never compiled
    assert summary["time"]["run_seconds"]["compile"] == 0.0


def test_a_named_precision_compiles_as_asked_and_reports_compile_and_steps_apart(tmp_path):
    trainer, summary = _run(tmp_path, "named", steps=10, precision="fp32")
    figures = summary["compile"]
    assert figures["verdict"] == "kept as asked" and _compiled(trainer)
    assert figures["eager_step_s"] > 0 and figures["compiled_step_s"] > 0 and figures["compile_s"] > 0
    assert summary["auto_precision"] is None  # no decision to keep it: the summary does
    if figures["compiled_step_s"] >= figures["eager_step_s"]:
        assert "slower than eager" in figures["explain"]
    # the compile is the summary's own figure, not the steps': forward and backward keep the compiled step's time
    assert summary["time"]["run_seconds"]["compile"] >= figures["compile_s"] * 0.99
    assert summary["time"]["step_ms"]["forward"] > 0 and summary["time"]["step_ms"]["backward"] > 0


@pytest.mark.parametrize(
    "error",
    [
        # a policy keeping norm in fp32 crashed torch.compile of an HF GPT-2 (dynamo's NameError on its torch
        # function mode): the run died at its first compiled step
        lambda: torch._dynamo.exc.InternalTorchDynamoError("NameError: name '___guard' is not defined"),
        # inductor's own errors come through unwrapped: a CPU without a working C++ compiler (CXX) crashed the
        # run where dynamo's fell back
        lambda: InductorError(RuntimeError("InvalidCxxCompiler: No working C++ compiler"), None),
    ],
    ids=["dynamo", "inductor"],
)
def test_a_compile_that_fails_at_its_first_step_is_said_and_the_run_trains_on_eagerly(
    tmp_path, monkeypatch, caplog, error
):
    from mixprec.trainer import compile_gate

    def broken(model, args):  # torch.compile that fails while compiling, before the forward computes
        def fail(*a, **k):
            raise error()

        model._compiled_call_impl = fail

    monkeypatch.setattr(compile_gate, "compile_model", broken)
    with caplog.at_level("WARNING", logger="mixprec.trainer"):
        trainer, summary = _run(tmp_path, "broken", steps=10, precision="fp32")
    assert trainer.state.global_step == 10 and not _compiled(trainer)
    assert summary["compile"]["verdict"] == "failed" and type(error()).__name__ in summary["compile"]["explain"]
    assert any("torch.compile failed on this model" in r.message for r in caplog.records)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    eager, _ = _run(tmp_path, "eager", steps=10, precision="fp32")
    assert losses == [e["loss"] for e in eager.state.log_history if "loss" in e]  # the step ran once, eagerly
