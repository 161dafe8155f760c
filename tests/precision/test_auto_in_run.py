"""precision="auto" racing as the run's own first steps (mixprec.precision.inrun, issue 23).

Each race step is a real training step of one candidate: its forward runs in that mode, its optimizer
update lands, and once the race decides every step runs the winner. Speeds are planted (a mode made slow
on purpose burns CPU time, the race's clock here), so the tests say what the race does with a measurement.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from conftest import make_batches, make_tiny_lm
from mixprec import Accelerator, Trainer, TrainingArguments
from mixprec.precision import registry
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import Bf16MixedPrecision, Fp16MixedPrecision
from planted_precisions import SleepyFp32
from trainer_utils import make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def _candidates(monkeypatch: pytest.MonkeyPatch, *classes: type) -> None:
    monkeypatch.setattr(registry, "auto_candidates", lambda device: [cls(device) for cls in classes])


def _auto_trainer(
    output_dir: Any, max_steps: int, examples: int = 256, model: Any = None, evaluate: bool = False, **args: Any
) -> Trainer:
    """A Trainer under precision="auto" on the tiny model: quiet, no plots, batch 4; ``args`` override."""
    arguments = TrainingArguments(
        **{
            "output_dir": str(output_dir),
            "disable_tqdm": True,
            "save_plots": False,
            "precision": "auto",
            "max_steps": max_steps,
            "per_device_train_batch_size": 4,
            "logging_steps": 1000,
            **args,
        }
    )
    evaluation = make_examples(32, seed=1) if evaluate else None
    model = model if model is not None else make_model()
    return Trainer(model, arguments, train_dataset=make_examples(examples), eval_dataset=evaluation)


class ModeSpy(torch.nn.Module):
    """The tiny LM, noting the autocast dtype each training forward ran under (None: no autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_tiny_lm(0)
        self.modes: list[torch.dtype | None] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        if self.training:
            on = torch.is_autocast_enabled("cpu")
            self.modes.append(torch.get_autocast_dtype("cpu") if on else None)
        return {"loss": self.lm(input_ids, labels=labels).loss}


def _loop(accelerator: Accelerator, model: torch.nn.Module, steps: int) -> dict[str, Any]:
    """A hand-written loop; per step: whether auto was still racing, whether the weights moved."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = make_batches(1)[0]
    racing, moved, modes = [], [], []
    for _ in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        accelerator.backward(model(batch["input_ids"], labels=batch["labels"])["loss"])
        optimizer.step()
        optimizer.zero_grad()
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
        racing.append(accelerator.precision_racing)
        modes.append(model.modes[-1] if isinstance(model, ModeSpy) else None)  # the step's own forward's mode
    return {"racing": racing, "moved": moved, "optimizer": optimizer, "model": model, "modes": modes}


def test_the_race_steps_are_real_steps_of_each_candidate_and_the_winner_runs_after(monkeypatch):
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)  # fp32's forward burns 30 ms: bf16 wins
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    out = _loop(accelerator, ModeSpy(), steps=24)
    decision = accelerator.auto_decision
    k = decision.in_run_steps
    assert decision.chosen == "bf16" and accelerator.mixed_precision == "bf16"
    # the race ran as steps 1..k: racing until the optimizer step of step k, decided from then on
    assert 0 < k < 24 and out["racing"] == [True] * (k - 1) + [False] * (24 - k + 1)
    raced = out["modes"][:k]
    assert raced.count(None) >= 2 and raced.count(torch.bfloat16) >= 2  # both candidates took real steps
    assert out["modes"][k:] == [torch.bfloat16] * (24 - k)  # then only the winner
    # every step, the race's too, updated the weights and counts as an optimizer step
    assert all(out["moved"]) and not out["optimizer"].step_was_skipped
    assert all(int(s["step"]) == 24 for s in out["optimizer"].optimizer.state.values())
    assert decision.step_seconds["fp32"] > decision.step_seconds["bf16"]
    assert f"the race ran as {k} of the run's training steps" in decision.explain()


def test_fp16_that_overflows_even_unscaled_is_excluded_and_its_steps_never_reach_the_weights(monkeypatch):
    class Overflowing(torch.nn.Module):
        """Activations past fp16's 65504: inf under fp16 autocast at any loss scale, finite in fp32."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, ids: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
            x = ids[:, :8].float()
            return {"loss": self.lin(x * 1e5).float().pow(2).mean() * 1e-10}

    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")
    _candidates(monkeypatch, SleepyFp32, Fp16MixedPrecision)  # fp16 would win on speed
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    torch.manual_seed(0)
    out = _loop(accelerator, Overflowing(), steps=20)
    decision = accelerator.auto_decision
    assert decision is not None and decision.chosen == "fp32"
    assert "inf/NaN" in decision.excluded["fp16"]
    assert all(torch.isfinite(p).all() for p in out["model"].parameters())


def test_a_mode_that_keeps_weights_in_low_precision_races_aside(monkeypatch):
    class PureBf16(Bf16MixedPrecision):
        """A candidate whose weights are bf16: a step cannot switch into it and out again."""

        @property
        def param_dtype(self) -> torch.dtype:  # type: ignore[override]
            return torch.bfloat16

    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")
    _candidates(monkeypatch, FullPrecision, PureBf16)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    out = _loop(accelerator, ModeSpy(), steps=1)
    assert accelerator.auto_decision.in_run_steps == 0 and out["racing"] == [False]


@pytest.mark.parametrize("max_steps, env, in_run", [(120, None, True), (120, "aside", False), (5, "aside", False)])
def test_the_trainer_races_a_long_run_as_its_steps_and_aside_when_asked(monkeypatch, tmp_path, max_steps, env, in_run):
    # (a run too short for an in-run race does not race unless asked: the test below)
    if env:
        monkeypatch.setenv("MIXPREC_AUTO_RACE", env)
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    trainer = _auto_trainer(tmp_path, max_steps, examples=64, save_strategy="no")
    trainer.train()
    decision = trainer.accelerator.auto_decision
    assert decision.chosen == "bf16" and trainer.accelerator.mixed_precision == "bf16"
    assert (decision.in_run_steps > 0) is in_run
    assert trainer.state.global_step == max_steps
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (event,) = [e for e in records if e.get("event") == "auto_precision"]
    assert event["chosen"] == "bf16" and event["step"] == (decision.in_run_steps if in_run else 0)


def test_a_checkpoint_saved_while_the_race_runs_resumes_and_races_again(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    first = Accelerator(mixed_precision="auto", verbose=False)
    out = _loop(first, ModeSpy(), steps=3)
    assert out["racing"] == [True] * 3
    assert "racing fp32, bf16 as the run's training steps (3 so far)" in first.precision.reason
    first.save_state(tmp_path / "state")
    again = Accelerator(mixed_precision="auto", verbose=False)
    optimizer = torch.optim.AdamW((model := ModeSpy()).parameters(), lr=1e-2)
    model, optimizer = again.prepare(model, optimizer)
    again.load_state(tmp_path / "state")
    assert again.auto_decision is None  # nothing decided to keep: this run's own steps race
    batch = make_batches(1)[0]
    for _ in range(24):
        again.backward(model(batch["input_ids"], labels=batch["labels"])["loss"])
        optimizer.step()
        optimizer.zero_grad()
    assert again.auto_decision.chosen == "bf16" and again.auto_decision.in_run_steps > 0


def test_the_cost_of_a_race_run_as_the_steps_is_their_time_over_the_winners():
    from mixprec.precision.race import Spent

    spent = Spent()
    for name, seconds in [("fp32", 5.0), ("bf16", 0.5), ("fp32", 1.0), ("bf16", 0.5)]:  # the run's first step: 5 s
        spent.add(seconds, name)
    medians = {"fp32": 1.0, "bf16": 0.5}
    # the first step's one-time costs (optimizer state, allocations) are every run's: it counts at fp32's median
    assert spent.cost(0.5, True, medians) == pytest.approx(2 * (1.0 - 0.5))
    assert spent.cost(0.5, False) == pytest.approx(7.0)  # aside from training, every trial is extra


def test_a_short_trainer_run_races_as_its_steps_and_its_summary_says_what_the_race_cost(monkeypatch, tmp_path):
    # issue 36: a 60-step run raced aside paid 30% of its time in trials; under 100 steps it now races in-run
    monkeypatch.delenv("MIXPREC_AUTO_RACE", raising=False)
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        precision="auto",
        max_steps=40,
        per_device_train_batch_size=4,
        logging_steps=1000,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(64))
    trainer.train()
    decision = trainer.accelerator.auto_decision
    assert decision.chosen == "bf16" and 0 < decision.in_run_steps < 40
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert decision.cost_seconds > 0
    assert summary["time"]["run_seconds"]["race"] == pytest.approx(
        decision.op_timing_seconds + decision.cost_seconds, abs=1e-3
    )
    assert summary["auto_precision"]["in_run_steps"] == decision.in_run_steps
    assert f"the race ran as {decision.in_run_steps} of the run's training steps" in decision.explain()


def test_a_short_in_run_race_drops_a_mode_it_cannot_afford_after_one_round():
    # fp16 is slower than bf16 (a safer mode): on a 40-step run the rounds to a verdict would pass the budget,
    # so it leaves after one timed round; fp32 and bf16 race on and bf16 wins
    from mixprec.precision import race

    times = {"fp32": 1.0, "bf16": 0.6, "fp16": 0.9}
    steps = race.decide_steps(["fp32", "bf16", "fp16"], device="cpu", threads=1, run_steps=40, in_run=True)
    ran: list[str] = []
    try:
        name, _ = next(steps)
        while True:
            ran.append(name)
            name, _ = steps.send((True, times[name] * (1.0 + 0.01 * (len(ran) % 3))))
    except StopIteration as stop:
        decision = stop.value
    assert decision.chosen == "bf16" and decision.dropped == {"fp16": 1}
    assert ran.count("fp16") == 2  # its warm-up step and one timed round
    assert ran.count("fp32") == 1 + race.EARLY_ROUNDS


def test_a_short_run_does_not_time_op_kinds_and_says_why(monkeypatch):
    from mixprec.precision import auto as auto_module

    timed: list[str] = []
    monkeypatch.setattr(auto_module, "measure_op_kinds", lambda *a, **k: timed.append("called"))
    monkeypatch.setenv("MIXPREC_AUTO_OP_POLICY", "1")
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    optimizer = torch.optim.AdamW((model := ModeSpy()).parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = make_batches(1)[0]
    accelerator.precision.settle(
        lambda: model(batch["input_ids"], labels=batch["labels"])["loss"], [model], batch=batch, run_steps=60
    )
    for _ in range(30):
        accelerator.backward(model(batch["input_ids"], labels=batch["labels"])["loss"])
        optimizer.step()
        optimizer.zero_grad()
    assert timed == []
    assert "per-op-kind timing skipped" in accelerator.auto_decision.op_timing


def test_a_short_in_run_race_keeps_a_mode_one_burst_made_slower_than_the_safest():
    # bf16's first timed step lands in a neighbour's burst (slower than fp32's): the budget may drop a mode
    # behind a safer low-precision one, never one behind the safest on a sample; the paired rounds go on
    from mixprec.precision import race

    times = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.9}
    steps = race.decide_steps(["fp32", "bf16", "fp16"], device="cpu", threads=1, run_steps=40, in_run=True)
    bf16_steps = 0
    try:
        name, _ = next(steps)
        while True:
            bf16_steps += name == "bf16"
            burst = 3.0 if name == "bf16" and bf16_steps == 2 else 1.0  # its first timed round
            name, _ = steps.send((True, times[name] * burst))
    except StopIteration as stop:
        decision = stop.value
    assert "bf16" not in decision.dropped and bf16_steps >= 1 + race.EARLY_ROUNDS  # timed on, not dropped


def test_a_long_trainer_run_races_the_measured_policy_as_its_steps_times_it_in_the_summary_and_resumes_in_it(
    monkeypatch, tmp_path
):
    # the default job's path: the op timing builds a policy that rules uniform bf16 out, the policy races fp32 as
    # the run's own steps, the summary's race counts the op timing too, and a resume keeps the policy
    from mixprec.precision import auto as auto_module
    from mixprec.precision.op_timing import KindTiming, OpTimingReport, policy_from_timings

    timings = (KindTiming("linear", 1, 1.0, 2.0), KindTiming("attention", 1, 12.0, 3.0))
    planted = lambda forward, device, base, budget_s: OpTimingReport(  # noqa: E731
        base, str(device), timings, policy_from_timings(base, timings), 0.25
    )
    monkeypatch.setattr(auto_module, "measure_op_kinds", planted)
    monkeypatch.setenv("MIXPREC_AUTO_OP_POLICY", "1")
    monkeypatch.delenv("MIXPREC_AUTO_RACE", raising=False)
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)

    def train(max_steps: int, resume: bool = False) -> Trainer:
        args = TrainingArguments(
            output_dir=str(tmp_path),
            disable_tqdm=True,
            save_plots=False,
            save_steps=200,
            precision="auto",
            max_steps=max_steps,
            per_device_train_batch_size=4,
            logging_steps=1000,
        )
        trainer = Trainer(make_model(), args, train_dataset=make_examples(64))
        trainer.train(resume_from_checkpoint=resume or None)
        return trainer

    decision = train(200).accelerator.auto_decision
    assert decision.chosen == "bf16:fp32_ops=attention" and decision.in_run_steps > 0
    assert set(decision.step_seconds) == {"fp32", "bf16:fp32_ops=attention"} and "bf16" in decision.excluded
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert decision.op_timing_seconds == 0.25
    assert summary["time"]["run_seconds"]["race"] == pytest.approx(0.25 + decision.cost_seconds, abs=1e-3)
    resumed = train(210, resume=True)
    assert resumed.accelerator.mixed_precision == "bf16:fp32_ops=attention"
    assert resumed.accelerator.auto_decision.source == "checkpoint" and resumed.state.global_step == 210
    summary = json.loads((tmp_path / "train_summary.json").read_text())  # the resumed run's: it raced nothing
    assert summary["time"]["run_seconds"]["race"] == 0.0


def test_a_run_too_short_for_any_race_to_pay_keeps_the_safest_mode_unraced_and_says_so(monkeypatch, tmp_path):
    # a 3-step GPT-2 run on a CPU raced aside for 12 s and trained for 10: below an in-run race's shortest run,
    # a race's own passes outnumber what the fastest mode could save over the whole run
    from mixprec.precision.inrun import shortest_in_run, too_short_to_race

    monkeypatch.delenv("MIXPREC_AUTO_RACE", raising=False)
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    shortest = shortest_in_run(2)

    def train(max_steps: int) -> Trainer:
        trainer = _auto_trainer(tmp_path / str(max_steps), max_steps)
        trainer.train()
        return trainer

    short = train(shortest - 1)
    decision = short.accelerator.auto_decision
    assert (decision.source, decision.chosen, decision.step_seconds) == ("guess", "fp32", {})
    assert (
        f"without racing: this run's {shortest - 1} steps are fewer than a race" in short.accelerator.precision.reason
    )
    summary = json.loads((tmp_path / str(shortest - 1) / "train_summary.json").read_text())
    assert summary["time"]["run_seconds"]["race"] == 0.0
    assert train(shortest).accelerator.auto_decision.source == "measured"  # long enough: raced
    # resumed for longer, the unraced run decides afresh (nothing was measured to keep): here it races as its steps
    args = short.args
    args.max_steps, args.output_dir = shortest + 40, str(tmp_path / str(shortest - 1))
    longer = Trainer(make_model(), args, train_dataset=make_examples(256))
    longer.train(resume_from_checkpoint=True)
    assert longer.accelerator.auto_decision.source == "measured" and longer.accelerator.auto_decision.in_run_steps > 0
    # a caller that chose how to race races, however short the run
    candidates = [SleepyFp32("cpu"), Bf16MixedPrecision("cpu")]
    assert too_short_to_race(3, candidates, asked=False) is None and too_short_to_race(None, candidates) is None
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "aside")
    assert too_short_to_race(3, candidates) is None


def test_a_race_as_the_steps_of_torchaos_8bit_adam_undoes_and_replays_its_quantised_states(monkeypatch, tmp_path):
    # each race step's transaction copies the optimizer state: torchao's 8-bit states have no clone(), and the
    # default `mixprec train --optim adamw_torch_8bit` crashed on its first race step
    pytest.importorskip("torchao.optim")
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)

    def train(precision: str) -> Trainer:
        model = make_model(width=128)  # 128x128: past 8-bit's minimum
        optim = {"optim": "adamw_torch_8bit", "precision": precision, "save_strategy": "no"}
        trainer = _auto_trainer(tmp_path / precision, 40, model=model, **optim)
        trainer.train()
        return trainer

    auto = train("auto")
    decision = auto.accelerator.auto_decision
    assert decision.in_run_steps > 0 and decision.replayed_steps == decision.in_run_steps
    states = auto.optimizer.optimizer.state.values()
    assert any(type(s.get("exp_avg")).__name__ == "OptimState8bit" for s in states)
    named = train(decision.chosen)  # the replay leaves the winner's run, quantised states and all
    for a, b in zip(auto.model.parameters(), named.model.parameters()):
        assert torch.equal(a, b)


def test_the_watch_follows_the_race_steps_once_and_not_their_replay(monkeypatch, tmp_path):
    # the replay takes the race's steps again without their events; the watch followed them a second time: a
    # second sample of each, and a bad race step's capsule written twice and listed twice in the summary
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    trainer = _auto_trainer(tmp_path, 40, save_strategy="no", precision_watch=1)  # a sample at every step
    trainer.train()
    decision = trainer.accelerator.auto_decision
    assert decision.replayed_steps == decision.in_run_steps > 0
    steps = [sample.step for sample in trainer.accelerator.watch.samples]
    assert sorted(steps) == list(range(1, 41))  # once each: 48 before, the 8 race steps twice


@pytest.mark.parametrize("eval_steps, in_run", [(10, True), (5, False)])
def test_the_race_ends_before_the_runs_first_evaluation_so_it_measures_the_chosen_modes_model(
    monkeypatch, tmp_path, eval_steps, in_run
):
    # an evaluation at a race step measured the race's model (the race ran 8-14 steps): the race as the steps now
    # fits before the first evaluation or save, and races aside where even EARLY_ROUNDS rounds would not fit
    monkeypatch.delenv("MIXPREC_AUTO_RACE", raising=False)
    _candidates(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    flow = {"evaluate": True, "eval_strategy": "steps", "eval_steps": eval_steps, "save_strategy": "no"}
    auto = _auto_trainer(tmp_path / "auto", 200, **flow)
    auto.train()
    decision = auto.accelerator.auto_decision
    assert (decision.in_run_steps > 0) is in_run and decision.in_run_steps < eval_steps
    named = _auto_trainer(tmp_path / "named", 200, **flow, precision=decision.chosen)
    named.train()
    evals = [[(h["step"], h["eval_loss"]) for h in t.state.log_history if "eval_loss" in h] for t in (auto, named)]
    assert evals[0] == evals[1]  # every evaluation, the first included, is the named mode's run's
