"""precision="auto" decided on the user's own training step (mixprec.precision.auto / race / trial).

No wall-clock thresholds: speed is planted, either with an injected clock or with a mode made slow on purpose
(a sleep far above any scheduling noise), so the tests say what auto does with a measurement, not what this
machine measures.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from conftest import make_batches, make_tiny_lm
from mixprec import Accelerator
from mixprec.precision import auto_cache, make_precision, race, registry
from mixprec.precision.auto import AutoPrecision
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import Bf16MixedPrecision, Fp16MixedPrecision
from mixprec.precision.race import AutoDecision, decide
from planted_precisions import SetUpBf16, SleepyBf16, SleepyFp32, SteadyBf16, burn


class FakeStep:
    """A planted training step on a fake clock: per mode, a trial passes ``CHECKPOINTS`` checkpoints (module
    calls), each costing ``cost[mode] / CHECKPOINTS``; ``setup[mode]`` is paid at each checkpoint the first
    time that mode reaches it (one-time kernel selection per layer, as on a GPU's first bf16 calls);
    ``noise(mode)`` multiplies a whole trial (a neighbour's burst). A trial past its deadline stops at the
    next checkpoint, as :func:`mixprec.precision.trial.run_trial` does."""

    CHECKPOINTS = 10

    def __init__(self, cost: dict[str, float], setup: dict[str, float] | None = None, noise: Any = None) -> None:
        self.now, self.cost, self.setup, self.noise = 0.0, cost, setup or {}, noise or (lambda name: 1.0)
        self.reached: dict[str, int] = {}
        self.runs: list[str] = []

    def __call__(self) -> float:
        return self.now

    def run(self, name: str, deadline: float | None = None, finite: bool = True) -> bool | race.Unfinished:
        self.runs.append(name)
        factor = self.noise(name)
        for k in range(self.CHECKPOINTS):
            if deadline is not None and self.now > deadline:
                return race.Unfinished(k)
            if k >= self.reached.get(name, 0):
                self.now += self.setup.get(name, 0.0)
                self.reached[name] = k + 1
            self.now += self.cost[name] / self.CHECKPOINTS * factor
        return finite


FakeClock = FakeStep


# -- the race and its rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cost, expected",
    [
        ({"fp32": 1.0, "bf16": 4.0, "fp16": 6.0}, "fp32"),  # emulated low precision: several times slower
        ({"fp32": 1.0, "bf16": 0.5, "fp16": 0.7}, "bf16"),
        ({"fp32": 1.0, "bf16": 0.8, "fp16": 0.5}, "fp16"),
        ({"fp32": 1.0, "bf16": 0.6, "fp16": 0.58}, "bf16"),  # fp16 must beat the safer bf16 by the margin
        ({"fp32": 1.0, "bf16": 0.97, "fp16": 0.96}, "fp32"),  # within the margin of fp32: the safer mode
    ],
)
def test_the_race_picks_the_fastest_by_a_margin_with_ties_to_the_safer_mode(cost, expected):
    clock = FakeClock(cost)
    decision = decide(["fp32", "bf16", "fp16"], clock.run, device="cpu", threads=1, clock=clock)
    assert decision.chosen == expected
    assert decision.step_seconds["fp32"] == pytest.approx(1.0)


def test_a_planted_slow_mode_is_dropped_in_its_warm_up_and_never_chosen():
    clock = FakeClock({"fp32": 1.0, "bf16": 0.5, "fp16": 15.0})  # fp16 emulated: 15x
    decision = decide(["fp32", "bf16", "fp16"], clock.run, device="cpu", threads=1, clock=clock)
    assert decision.chosen == "bf16"
    # stopped at its deadline three times at the same place (slow, not setting up), never timed
    assert clock.runs.count("fp16") == 3 and decision.dropped == {"fp16": 0}
    assert "fp16 dropped" in decision.explain()


def test_one_time_setup_never_counts_against_a_candidate_that_is_faster_once_settled():
    # issue 28: on a GPU the first bf16 calls pay kernel selection; bf16's first trial here costs 21x fp32's
    # step (2.0 at each of its 10 layers, the first time), its settled step half of fp32's. It must win, and
    # its timed samples hold no setup. fp16 is slow every time: dropped.
    clock = FakeClock({"fp32": 1.0, "bf16": 0.5, "fp16": 15.0}, setup={"bf16": 2.0, "fp32": 0.5})
    decision = decide(["fp32", "bf16", "fp16"], clock.run, device="cpu", threads=1, clock=clock)
    assert decision.chosen == "bf16" and "bf16" not in decision.dropped
    assert decision.step_seconds["bf16"] == pytest.approx(0.5) and decision.best_seconds["fp32"] == pytest.approx(1.0)
    assert decision.dropped == {"fp16": 0}


def test_a_race_beside_a_busy_neighbour_gives_the_same_verdict_whatever_the_bursts():
    # A neighbour slows one trial in ten by up to 3x (bursts: on the wall clock beside a busy process bf16
    # measured 0.85x-2.17x for a 1.68x step). Paired rounds and an interval must give one verdict for every
    # draw: bf16 1.68x faster wins 30/30; a bf16 only 2% faster (a tie) goes to fp32 30/30.
    import random

    for cost, expected in [({"fp32": 1.0, "bf16": 1 / 1.68}, "bf16"), ({"fp32": 1.0, "bf16": 0.98}, "fp32")]:
        chosen = []
        for seed in range(30):
            rng = random.Random(seed)
            clock = FakeClock(cost, noise=lambda name, rng=rng: 1.0 + (2.0 * rng.random() if rng.random() < 0.1 else 0))
            chosen.append(decide(["fp32", "bf16"], clock.run, device="cpu", threads=1, clock=clock).chosen)
        assert chosen == [expected] * 30, (cost, chosen)


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ([0.60, 0.61, 0.59, 0.60, 0.62, 0.60], race.WINS),  # clearly faster
        ([0.60, 0.61, 1.80, 0.60, 0.62, 0.60, 0.6, 0.6, 0.6], race.WINS),  # a neighbour's burst: an outlier
        ([1.00, 0.99, 1.01, 1.00, 0.98, 1.00], race.NOT_FASTER),  # level: a tie, the safer mode's
        ([1.30, 1.20, 1.25, 1.3, 1.2, 1.25], race.NOT_FASTER),  # slower
        ([0.60, 1.40, 0.90, 0.6, 1.4, 0.9], race.UNDECIDED),  # too noisy to tell: more rounds
        ([0.5, 0.5], race.UNDECIDED),  # fewer than EARLY_ROUNDS pairs: no verdict yet
        ([0.64, 0.66, 0.65], race.WINS),  # a clear, steady gap decides on EARLY_ROUNDS pairs (t-interval)
        ([0.64, 1.90, 0.65], race.UNDECIDED),  # ... a burst among so few widens it: more rounds
        ([1.00, 0.995, 1.005], race.NOT_FASTER),  # a steady tie too
        ([0.90, 0.96, 0.93], race.UNDECIDED),  # near the margin: more rounds
    ],
)
def test_the_verdict_on_paired_samples_separates_or_declares_a_tie(ratios, expected):
    safer = [1.0 + 0.1 * i for i in range(len(ratios))]  # the rounds' conditions differ; the pairs carry it
    mode = [s * r for s, r in zip(safer, ratios)]
    assert race.verdict(mode, safer) == expected


def test_a_mode_wins_only_against_every_safer_mode_still_racing():
    samples = {"fp32": [1.0] * 6, "bf16": [0.6] * 6, "fp16": [0.59, 0.58, 0.6] * 2}
    assert race.choose_paired(["fp32", "bf16", "fp16"], samples, {}) == "bf16"  # fp16 ties bf16
    samples["fp16"] = [0.3, 0.31, 0.29] * 2
    assert race.choose_paired(["fp32", "bf16", "fp16"], samples, {}) == "fp16"
    assert race.choose_paired(["fp32", "bf16", "fp16"], samples, {"fp16": 3}) == "bf16"


def test_a_pair_still_undecided_when_the_rounds_run_out_is_a_tie_for_the_safer_mode():
    # A busy machine: bf16's best times look 10% faster, but the paired interval still spans the margin
    # when the rounds run out: a tie, fp32 every time (not whichever way the best times fell).
    fp32 = [1.00, 1.30, 1.02, 1.00, 1.25, 1.01]
    bf16 = [0.90, 0.89, 1.20, 0.92, 0.90, 1.10]
    assert race.verdict(bf16, fp32) == race.UNDECIDED
    assert race.choose_paired(["fp32", "bf16"], {"fp32": fp32, "bf16": bf16}, {}) == "fp32"


def test_the_race_stays_within_its_budget_share_of_the_run():
    # A tie never separates: without a budget it runs MAX_ROUNDS; a 100-step run allows 3% of 100 steps.
    rng = __import__("random").Random(0)
    clock = FakeClock({"fp32": 1.0, "bf16": 0.95}, noise=lambda name: 1.0 + 0.1 * rng.random())
    free = decide(["fp32", "bf16"], clock.run, device="cpu", threads=1, clock=clock)
    clock = FakeClock({"fp32": 1.0, "bf16": 0.95}, noise=lambda name: 1.0 + 0.1 * rng.random())
    bounded = decide(["fp32", "bf16"], clock.run, device="cpu", threads=1, clock=clock, run_steps=100)
    assert free.rounds > bounded.rounds == race.MIN_ROUNDS and bounded.chosen == "fp32"


def test_a_clear_gap_is_decided_in_early_rounds_and_the_beaten_safest_mode_stops_running():
    # fp32 1.0, bf16 0.6, fp16 0.75 (between), 3% noise: both beat fp32 within EARLY_ROUNDS rounds, so fp32
    # stops running; fp16 is not faster than bf16 and stops too: the race ends before MIN_ROUNDS rounds.
    rng = __import__("random").Random(1)
    clock = FakeClock({"fp32": 1.0, "bf16": 0.6, "fp16": 0.75}, noise=lambda name: 1.0 + 0.03 * rng.random())
    decision = decide(["fp32", "bf16", "fp16"], clock.run, device="cpu", threads=1, clock=clock)
    assert decision.chosen == "bf16" and decision.rounds < race.MIN_ROUNDS
    timed = clock.runs[-decision.rounds * 3 :]
    assert timed.count("fp32") <= race.EARLY_ROUNDS


def test_a_fast_mode_whose_trial_is_not_finite_is_excluded_with_the_reason():
    clock = FakeClock({"fp32": 1.0, "bf16": 0.9, "fp16": 0.3})
    decision = decide(
        ["fp32", "bf16", "fp16"],
        lambda name, deadline: clock.run(name, deadline, finite=name != "fp16"),
        device="cpu",
        threads=1,
        clock=clock,
    )
    assert decision.chosen == "bf16"
    assert "fp16" in decision.excluded and "inf/NaN" in decision.excluded["fp16"]
    assert "fp16 excluded" in decision.explain()


def test_the_decision_round_trips_through_json():
    d = AutoDecision("bf16", {"fp32": 0.2, "bf16": 0.1}, {"fp32": 0.19, "bf16": 0.09}, {"fp16": "x"}, rounds=3)
    again = AutoDecision.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again == d and "bf16" in again.table() and "<- chosen" in again.table()


# -- on a real model -----------------------------------------------------------------------------------


def _auto_with(monkeypatch: pytest.MonkeyPatch, *classes: type) -> None:
    monkeypatch.setattr(registry, "auto_candidates", lambda device: [cls(device) for cls in classes])


def _train(accelerator: Accelerator, steps: int = 4, seed: int = 0) -> torch.nn.Module:
    model = DropoutNormLM(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for batch in make_batches(steps, seed=seed):
        accelerator.backward(model(batch["input_ids"], labels=batch["labels"])["loss"])
        optimizer.step()
        optimizer.zero_grad()
    return model


class DropoutNormLM(torch.nn.Module):
    """The tiny LM with dropout (draws from the RNG) and a BatchNorm (a buffer the forward updates): what a
    trial must leave exactly as it found."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.lm = make_tiny_lm(seed)
        self.drop = torch.nn.Dropout(0.2)
        self.norm = torch.nn.BatchNorm1d(32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.drop(self.lm.embed(input_ids))
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        logits = self.lm.head(torch.nn.functional.gelu(self.lm.hidden(h)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def test_a_mode_made_slow_on_purpose_is_not_chosen(monkeypatch):
    _auto_with(monkeypatch, FullPrecision, SleepyBf16)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    _train(accelerator, steps=1)
    assert accelerator.mixed_precision == "fp32"
    d = accelerator.auto_decision
    assert d.source == "measured" and d.chosen == "fp32"
    assert "bf16" in d.dropped or d.step_seconds["bf16"] > d.step_seconds["fp32"]


def test_a_mode_faster_on_the_real_step_is_chosen(monkeypatch):
    # The converse: the planted slowness is on fp32, so auto must leave it (a test that always-fp32 fails).
    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    _train(accelerator, steps=1)
    assert accelerator.mixed_precision == "bf16"
    assert type(accelerator.precision) is Bf16MixedPrecision
    assert accelerator.auto_decision.step_seconds["fp32"] > accelerator.auto_decision.step_seconds["bf16"]


def test_the_measured_steps_are_not_lost_training_equals_the_chosen_mode_by_name(monkeypatch):
    # Dropout draws from the RNG and BatchNorm updates its statistics in every trial forward: the run after
    # the race must still be bit-identical to one that asked for the winner by name.
    torch.manual_seed(1234)  # the same RNG stream for both runs (dropout)
    named = _train(Accelerator(mixed_precision="bf16", verbose=False))
    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    torch.manual_seed(1234)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    auto = _train(accelerator)
    assert accelerator.mixed_precision == "bf16"
    for (name, a), (_, b) in zip(auto.state_dict().items(), named.state_dict().items()):
        assert torch.equal(a, b), name


def test_fp16_that_overflows_on_the_real_step_is_excluded_even_if_fastest(monkeypatch):
    class Overflowing(torch.nn.Module):
        """Activations past fp16's 65504: inf under fp16 autocast, finite in fp32 and bf16."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * 1e5).float().pow(2).mean() * 1e-10

    _auto_with(monkeypatch, SleepyFp32, Fp16MixedPrecision)  # fp16 would win on speed
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    torch.manual_seed(0)
    model = accelerator.prepare(Overflowing())
    accelerator.backward(model(torch.randn(4, 8)))
    assert accelerator.mixed_precision == "fp32"
    assert "inf/NaN" in accelerator.auto_decision.excluded["fp16"]


def test_an_unscaled_fp16_overflow_of_the_gradient_alone_retries_lower_scales(monkeypatch):
    # Gradients that overflow only at the scaler's 2^16 are what loss scaling backs off from: not a reason
    # to exclude fp16.
    _auto_with(monkeypatch, SleepyFp32, Fp16MixedPrecision)
    accelerator = Accelerator(
        mixed_precision="auto", verbose=False, scaler_kwargs={"init_scale": 2.0**24, "max_scale": 2.0**24}
    )
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    x = torch.full((4, 8), 30.0)
    accelerator.backward(model(x).float().pow(2).sum())
    assert accelerator.mixed_precision == "fp16" and not accelerator.auto_decision.excluded


def test_eval_before_the_first_training_step_runs_fp32_and_does_not_decide():
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    model = accelerator.prepare(make_tiny_lm())
    batch = make_batches(1)[0]
    model.eval()
    with torch.no_grad():
        out = model(batch["input_ids"], labels=batch["labels"])
    assert out.logits.dtype == torch.float32 and accelerator.precision_pending


# -- one decision per run: resume, processes, cache ------------------------------------------------------


def test_a_resumed_run_keeps_the_recorded_decision_without_measuring(monkeypatch, tmp_path):
    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    first = Accelerator(mixed_precision="auto", verbose=False)
    model = _train(first, steps=2)
    saved = first.save_state(tmp_path / "state")
    meta = json.loads((saved / "accelerator.json").read_text())
    assert meta["mixed_precision"] == "bf16" and meta["auto"]["chosen"] == "bf16"

    def no_race(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a resumed run must not race again")

    monkeypatch.setattr("mixprec.precision.auto.decide", no_race)
    _auto_with(monkeypatch, FullPrecision, Bf16MixedPrecision, Fp16MixedPrecision)
    again = Accelerator(mixed_precision="auto", verbose=False)
    resumed = DropoutNormLM()
    resumed, _ = again.prepare(resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    again.load_state(tmp_path / "state")
    assert again.mixed_precision == "bf16" and again.auto_decision.source == "checkpoint"
    assert again.auto_decision.step_seconds == first.auto_decision.step_seconds
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_a_repeated_run_reuses_the_cached_decision_and_cache_off_measures_again(monkeypatch, tmp_path):
    cache = tmp_path / "auto.json"
    monkeypatch.setenv("MIXPREC_AUTO_CACHE", str(cache))
    _auto_with(monkeypatch, SleepyFp32, SteadyBf16)
    first = Accelerator(mixed_precision="auto", verbose=False)
    _train(first, steps=1)
    assert first.auto_decision.source == "measured" and cache.is_file()
    second = Accelerator(mixed_precision="auto", verbose=False)
    _train(second, steps=1)
    assert second.auto_decision.source == "cache" and second.mixed_precision == "bf16"
    assert "reused a cached race" in second.precision.reason and "within the noise" in second.precision.reason
    assert first.auto_decision.measured_at in second.precision.reason  # says when it was measured
    # this run's cost is its re-check (a few trials of bf16), not the cached race's (both modes, every round)
    assert 0 < second.auto_decision.seconds_this_run < first.auto_decision.seconds_this_run
    monkeypatch.setenv("MIXPREC_AUTO_CACHE", "0")
    third = Accelerator(mixed_precision="auto", verbose=False)
    _train(third, steps=1)
    assert third.auto_decision.source == "measured"


def test_a_cached_race_that_the_run_contradicts_is_raced_again_and_says_so(monkeypatch, tmp_path):
    # issue 29: a race measured under load (6x the quiet step) was reused as fact. Plant a cached decision
    # whose bf16 time is 20x what bf16 takes now: the run re-checks it, races again and says why.
    cache = tmp_path / "auto.json"
    monkeypatch.setenv("MIXPREC_AUTO_CACHE", str(cache))
    _auto_with(monkeypatch, SleepyFp32, SteadyBf16)
    first = Accelerator(mixed_precision="auto", verbose=False)
    _train(first, steps=1)
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        entry["step_seconds"] = {k: v * 20 for k, v in entry["step_seconds"].items()}
        entry["best_seconds"] = {k: v * 20 for k, v in entry["best_seconds"].items()}
        entry["measured_at"] = "2020-01-01 00:00 UTC"
    cache.write_text(json.dumps(entries))
    second = Accelerator(mixed_precision="auto", verbose=False)
    _train(second, steps=1)
    d = second.auto_decision
    assert d.source == "measured" and d.chosen == "bf16"
    assert "the cached race of 2020-01-01 00:00 UTC did not hold" in d.checked and "raced again" in d.checked
    assert "did not hold" in second.precision.reason
    stored = next(iter(json.loads(cache.read_text()).values()))
    assert stored["measured_at"] != "2020-01-01 00:00 UTC"  # the fresh race replaced it


def test_a_candidate_paying_one_time_setup_still_wins_on_its_settled_steps(monkeypatch):
    # issue 28 on a CPU: bf16's first forwards of each layer cost 60 ms (setup), twice fp32's whole trial;
    # its settled trial is far faster. Warm-up must absorb the setup, not drop bf16 or time it.
    _auto_with(monkeypatch, SleepyFp32, SetUpBf16)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    _train(accelerator, steps=1)
    d = accelerator.auto_decision
    assert accelerator.mixed_precision == "bf16" and d.chosen == "bf16" and "bf16" not in d.dropped
    assert d.step_seconds["bf16"] < d.step_seconds["fp32"] / 2


def test_the_cache_key_changes_with_the_batch_shape_and_the_model():
    dev = torch.device("cpu")
    a = auto_cache.fingerprint(dev, [make_tiny_lm()], ["(8, 8):torch.int64"], ["fp32", "bf16"], 1)
    assert a == auto_cache.fingerprint(dev, [make_tiny_lm(1)], ["(8, 8):torch.int64"], ["fp32", "bf16"], 1)
    assert a != auto_cache.fingerprint(dev, [make_tiny_lm()], ["(4, 8):torch.int64"], ["fp32", "bf16"], 1)
    assert a != auto_cache.fingerprint(dev, [torch.nn.Linear(2, 2)], ["(8, 8):torch.int64"], ["fp32", "bf16"], 1)
    assert a != auto_cache.fingerprint(dev, [make_tiny_lm()], ["(8, 8):torch.int64"], ["fp32", "bf16"], 2)


def test_candidates_are_the_registered_modes_that_declare_it_safest_first():
    names = [p.name for p in registry.auto_candidates(torch.device("cpu"))]
    assert names == ["fp32", "bf16", "fp16"]
    auto = registry.make_precision("auto", "cpu")
    assert isinstance(auto, AutoPrecision) and auto.pending and auto.name == "auto"
    assert race.MARGIN == 0.05


@pytest.mark.gpu
def test_on_cuda_auto_races_the_same_way_and_trains_in_the_winner():
    accelerator = Accelerator(mixed_precision="auto", device="cuda", verbose=False)
    model = make_tiny_lm().cuda()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = {k: v.cuda() for k, v in make_batches(1)[0].items()}
    accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
    optimizer.step()
    d = accelerator.auto_decision
    assert d.device == "cuda" and d.source == "measured" and accelerator.mixed_precision == d.chosen
    assert set(d.step_seconds) | set(d.dropped) | set(d.excluded) == set(d.candidates)


def test_a_diagnosis_that_saw_fp16_overflow_excludes_fp16_from_the_race(monkeypatch):
    from types import SimpleNamespace

    from mixprec.trainer.loop import overflowed_formats

    event = SimpleNamespace(phase="forward", module="h.3.mlp", what="output")
    unsafe = overflowed_formats(SimpleNamespace(nonfinite_checks={"fp16": event, "bf16": None}))
    assert unsafe == {"fp16": "the diagnosis saw fp16 overflow (forward of h.3.mlp, output)"}
    assert overflowed_formats(SimpleNamespace(nonfinite_checks={"fp16": None})) == {}
    assert overflowed_formats(None) == {}
    _auto_with(monkeypatch, SleepyFp32, Fp16MixedPrecision)  # fp16 would win on speed
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    model = accelerator.prepare(make_tiny_lm())
    batch = make_batches(1)[0]
    accelerator.settle_precision(
        lambda: model(batch["input_ids"], labels=batch["labels"]).loss, batch, unsafe_formats=unsafe
    )
    assert accelerator.mixed_precision == "fp32" and "diagnosis saw fp16 overflow" in accelerator.precision.reason


def test_the_race_stops_as_soon_as_every_pair_is_separated_and_runs_on_while_one_is_not():
    clear = FakeClock({"fp32": 1.0, "bf16": 0.5})
    assert decide(["fp32", "bf16"], clear.run, device="cpu", threads=1, clock=clear).rounds == race.EARLY_ROUNDS
    rng = __import__("random").Random(1)
    close = FakeClock({"fp32": 1.0, "bf16": 0.95}, noise=lambda name: 1.0 + 0.2 * rng.random())  # at the margin
    decision = decide(["fp32", "bf16"], close.run, device="cpu", threads=1, clock=close)
    assert decision.rounds > race.MIN_ROUNDS
    low, high = decision.speedup_interval["bf16"]
    assert low <= 1 / 0.95 <= high


class AttentionLM(torch.nn.Module):
    """A tiny model whose attention, when it runs in bf16, burns 20 ms of CPU: bf16 attention slower than fp32
    attention while its linear layers gain, as measured on avx512_bf16 CPUs (issue 23)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 16).unbind(2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if out.dtype == torch.bfloat16:
            burn(0.02)
        return out.float().pow(2).mean()


def _auto_decides_with_planted_op_timing(monkeypatch, timings):
    """Accelerator("auto") racing on AttentionLM, its per-op timing planted as ``timings``; its decision."""
    from mixprec.precision import auto as auto_module
    from mixprec.precision.op_timing import OpTimingReport, policy_from_timings

    def measured(forward, device, base, budget_s):
        forward()  # the real forward runs (its state restored by the race), as the real timing's does
        return OpTimingReport(base, str(device), timings, policy_from_timings(base, timings), 0.01)

    monkeypatch.setattr(auto_module, "measure_op_kinds", measured)
    monkeypatch.setenv("MIXPREC_AUTO_OP_POLICY", "1")
    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    model = accelerator.prepare(AttentionLM())
    accelerator.backward(model(torch.randn(2, 4, 16)))
    assert accelerator.mixed_precision == "bf16:fp32_ops=attention"  # neither uniform mode
    return accelerator.auto_decision


def test_a_measured_per_op_policy_joins_the_race_and_wins_when_its_whole_step_is_fastest(monkeypatch):
    from mixprec.precision.op_timing import KindTiming

    # the per-op timing, planted: attention 2x slower in bf16, 8% of the step (under DOMINATED: bf16 races too)
    timings = (KindTiming("linear", 1, 10.0, 20.0), KindTiming("attention", 1, 2.0, 1.0))
    decision = _auto_decides_with_planted_op_timing(monkeypatch, timings)
    # raced safest first, the policy between fp32 and uniform bf16 (it holds more in fp32 than bf16 does)
    assert decision.candidates == ["fp32", "bf16:fp32_ops=attention", "bf16"]
    assert decision.step_seconds["bf16:fp32_ops=attention"] < decision.step_seconds["bf16"]
    assert "attention" in decision.op_timing and "policy: bf16:fp32_ops=attention" in decision.table()
    assert decision.op_timing_seconds == 0.01  # the timing's own seconds, counted in the run's race time


def test_a_policy_that_saves_a_large_share_of_its_base_modes_step_is_raced_without_the_base(monkeypatch):
    # issue 36: on the main job bf16's attention cost 47.6 ms against 25.2 ms in fp32 (24% of the step); racing
    # uniform bf16 as well only spent steps (and their replay) on a mode that could not win
    from mixprec.precision.op_timing import KindTiming

    timings = (KindTiming("linear", 1, 1.0, 2.0), KindTiming("attention", 1, 12.0, 3.0))  # saves 69%
    decision = _auto_decides_with_planted_op_timing(monkeypatch, timings)
    assert set(decision.step_seconds) == {"fp32", "bf16:fp32_ops=attention"}  # bf16 never ran a trial
    assert "12.0 ms against 3.0 ms in fp32 (69% of its op time)" in decision.excluded["bf16"]


def test_a_model_with_gradient_checkpointing_races_the_uniform_modes_without_timing_op_kinds(monkeypatch):
    # the recompute in backward does not run a policy's fp32 regions (policy.py refuses it): `mixprec train
    # --gradient-checkpointing` under auto raced such a policy and crashed on its first backward
    from mixprec.models import GPT, GPTConfig
    from mixprec.precision import auto as auto_module

    def never(*args, **kwargs):
        raise AssertionError("op kinds timed for a model that recomputes its activations")

    monkeypatch.setattr(auto_module, "measure_op_kinds", never)
    monkeypatch.setenv("MIXPREC_AUTO_OP_POLICY", "1")
    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model.gradient_checkpointing_enable()
    model = accelerator.prepare(model)
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    decision = accelerator.auto_decision
    assert decision.op_timing.startswith("per-op-kind timing skipped: the model recomputes its activations")
    assert set(decision.step_seconds) <= {"fp32", "bf16"}  # no policy raced
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_per_op_timing_that_finds_nothing_to_keep_in_fp32_races_the_uniform_modes_only(monkeypatch):
    from mixprec.precision import auto as auto_module
    from mixprec.precision.op_timing import KindTiming, OpTimingReport

    def measured(forward, device, base, budget_s):
        return OpTimingReport(base, str(device), (KindTiming("linear", 1, 1.0, 2.0),), base, 0.01)

    monkeypatch.setattr(auto_module, "measure_op_kinds", measured)
    monkeypatch.setenv("MIXPREC_AUTO_OP_POLICY", "1")
    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    _train(accelerator, steps=1)
    assert accelerator.mixed_precision == "bf16"
    assert set(accelerator.auto_decision.step_seconds) == {"fp32", "bf16"}


def test_a_mode_whose_matmuls_are_emulated_on_this_cpu_is_left_out_before_its_first_trial(monkeypatch):
    # GPT-2 124M on a CPU without native fp16: one fp16 trial sat a minute inside one kernel (issue 23). A
    # layer-sized GEMM probe (a fraction of a second, once per process) shows it first; the race never runs it.
    from mixprec.precision import probe

    monkeypatch.setattr(probe, "_gemm_cache", {torch.float32: 1.0, torch.bfloat16: 0.4, torch.float16: 20.0})
    monkeypatch.setenv("MIXPREC_AUTO_PREFILTER", "1")
    trials: list[str] = []

    class CountedFp16(Fp16MixedPrecision):
        def autocast(self):
            trials.append(self.name)
            return super().autocast()

    _auto_with(monkeypatch, SleepyFp32, Bf16MixedPrecision, CountedFp16)
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    _train(accelerator, steps=1)
    decision = accelerator.auto_decision
    assert trials == []  # not one fp16 trial
    assert "float16 matmuls ran 20.0x slower than fp32's" in decision.excluded["fp16"]
    assert accelerator.mixed_precision == "bf16" and "fp16" not in decision.step_seconds


def test_the_matmul_probe_keeps_native_dtypes_and_finds_this_machines_emulated_ones(monkeypatch):
    from mixprec.precision import probe
    from mixprec.precision.probe import PREFILTER_RATIO, emulated_candidates, gemm_ratio

    monkeypatch.setattr(probe, "_gemm_cache", {torch.float32: 1.0, torch.bfloat16: 1.3, torch.float16: 4.0})
    cpu = torch.device("cpu")
    candidates = [FullPrecision(cpu), Bf16MixedPrecision(cpu), Fp16MixedPrecision(cpu)]
    assert emulated_candidates(candidates) == {}  # slower, but not by emulation's margin: the race decides
    monkeypatch.setattr(probe, "_gemm_cache", {})
    measured = gemm_ratio(torch.float16)  # real: the ratio this machine's kernels give
    assert measured > 0 and set(probe._gemm_cache) == {torch.float32, torch.float16}
    assert ("fp16" in emulated_candidates(candidates)) == (measured >= PREFILTER_RATIO)


def test_a_resumed_run_keeps_the_measured_policy_its_checkpoint_recorded():
    # `mixprec train --resume` of the default job failed: the policy auto measured is no registered candidate,
    # so the fresh AutoPrecision refused the decision its checkpoint recorded
    auto = make_precision("auto", "cpu")
    chosen = "bf16:fp32_ops=attention"
    record = AutoDecision(chosen, {"fp32": 0.11, chosen: 0.07}, device="cpu", candidates=["fp32", chosen, "bf16"])
    auto.adopt_recorded(chosen, record.to_dict())
    assert auto.name == chosen and auto.decision.source == "checkpoint"
    assert auto.resolved.policy.fp32_ops == frozenset({"attention"})  # the policy itself, not uniform bf16
    other = {**record.to_dict(), "chosen": "bf16-pure"}  # a mode auto does not race: still refused
    with pytest.raises(ValueError, match="the recorded decision 'bf16-pure' cannot run here \\(not a candidate on cpu"):
        make_precision("auto", "cpu").adopt_recorded("bf16-pure", other)


def test_a_resumed_fp16_decision_that_step_in_backward_leaves_out_names_that_cause():
    # a GPU run's auto chose fp16; resumed with step_in_backward, auto races without fp16, and the refusal said
    # only "not a candidate on cuda (fp32, bf16)", which hid the flag that left it out
    from mixprec.accelerator.step_in_backward import LEFT_OUT, fit_for_step_in_backward

    auto = make_precision("auto", "cpu")
    assert "fp16" in [p.name for p in auto.candidates]
    assert fit_for_step_in_backward(auto)
    record = AutoDecision("fp16", {"fp32": 0.11, "fp16": 0.05}, device="cpu", candidates=["fp32", "fp16"])
    with pytest.raises(ValueError, match="'fp16' cannot run here") as refused:
        auto.adopt_recorded("fp16", record.to_dict())
    assert LEFT_OUT in str(refused.value) and "precision='fp16'" in str(refused.value)


def test_an_accelerator_that_loads_the_state_of_an_auto_run_keeps_its_measured_policy(monkeypatch, tmp_path):
    # Accelerator.load_state of a run whose auto chose a measured policy raised "not a candidate" before
    from mixprec.precision.op_timing import KindTiming

    timings = (KindTiming("linear", 1, 1.0, 2.0), KindTiming("attention", 1, 12.0, 3.0))
    _auto_decides_with_planted_op_timing(monkeypatch, timings)  # the planted policy wins; then a run to resume:
    first = Accelerator(mixed_precision="auto", verbose=False)
    model = first.prepare(AttentionLM())
    first.backward(model(torch.randn(2, 4, 16)))
    first.save_state(str(tmp_path / "state"))
    again = Accelerator(mixed_precision="auto", verbose=False)
    again.prepare(AttentionLM())
    again.load_state(str(tmp_path / "state"))
    assert again.mixed_precision == first.mixed_precision == "bf16:fp32_ops=attention"
    assert again.auto_decision.source == "checkpoint"
