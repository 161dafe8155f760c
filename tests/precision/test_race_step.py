"""A step of auto's in-run race is a transaction (mixprec.precision.race_step, issue 34).

The race's trials are real training steps. One whose gradients are non-finite must leave the run exactly as a
skipped batch of the chosen mode would (weights, moments, optimizer step counts, scheduler, RNG, the step
record's counters); one whose mode raises must leave the state as it was before the step. The race's clock is
planted (every step takes 1 ms), so which step runs in which mode does not depend on the machine's load.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch

from conftest import make_batches, make_tiny_lm, race_in_run
from mixprec import Accelerator, Trainer, TrainingArguments
from mixprec.precision import auto, race_step
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import Bf16MixedPrecision, Fp16MixedPrecision
from trainer_utils import make_examples

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

STEPS = 12


@pytest.fixture
def in_run_race(monkeypatch: pytest.MonkeyPatch) -> Any:
    """auto races in-run, every candidate (no cache, no prefilter, no policy), on a clock of 1 ms a step."""
    candidates = race_in_run(monkeypatch)
    ticks = itertools.count()
    monkeypatch.setattr(auto, "race_clock", lambda device: (lambda: next(ticks) * 1e-3, "planted clock"))
    return candidates


class Planted(torch.nn.Module):
    """The tiny LM with a planted failure: ``overflow`` makes the loss inf in the steps it names (the step's
    index from 0) or, as ``"fp16"``, wherever the forward runs under fp16 autocast; ``modes`` notes each
    training forward's autocast dtype. A draw from the RNG each forward shows whether RNG state moved."""

    def __init__(self, overflow: set[int] | str = frozenset()) -> None:
        super().__init__()
        self.lm = make_tiny_lm(0)
        self.overflow = overflow
        self.modes: list[torch.dtype | None] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        step = len(self.modes)
        self.modes.append(dtype)
        loss = self.lm(input_ids, labels=labels).loss + 0.0 * torch.rand(())
        planted = dtype == torch.float16 if self.overflow == "fp16" else step in self.overflow
        return {"loss": loss * float("inf") if planted else loss}


def _train(precision: str, model: Planted, steps: int = STEPS) -> dict[str, Any]:
    """A hand-written Accelerator loop with clipping and a prepared LR schedule, one batch per step."""
    accelerator = Accelerator(mixed_precision=precision, verbose=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    torch.manual_seed(1)
    for batch in make_batches(steps, seed=3):
        accelerator.backward(model(batch["input_ids"], labels=batch["labels"])["loss"])
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {"accelerator": accelerator, "model": model, "optimizer": optimizer, "schedule": schedule}


def _state(run: dict[str, Any]) -> dict[str, Any]:
    """What a skipped batch must leave as the chosen mode's own skip would: weights, moments and step counts,
    the schedule's position, the step record's counters, the RNG."""
    record = run["accelerator"].scaler.record
    moments = [{k: v.clone() for k, v in s.items()} for s in run["optimizer"].optimizer.state.values()]
    return {
        "weights": [p.detach().clone() for p in run["model"].parameters()],
        "moments": moments,
        "schedule": run["schedule"].scheduler.last_epoch,
        "record": (record.steps, record.skipped_steps, record.consecutive_skips, [e.skipped for e in record.history]),
        "rng": torch.random.get_rng_state(),
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got["weights"], want["weights"]))
    assert len(got["moments"]) == len(want["moments"])
    for a, b in zip(got["moments"], want["moments"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got["schedule"] == want["schedule"]
    assert got["record"] == want["record"]
    assert torch.equal(got["rng"], want["rng"])


def test_a_race_step_that_overflows_is_the_chosen_modes_skipped_batch(in_run_race):
    in_run_race(FullPrecision, Fp16MixedPrecision)  # fp16 overflows at every scale: excluded, fp32 chosen
    raced = _train("auto", Planted(overflow="fp16"))
    decision = raced["accelerator"].auto_decision
    assert decision is not None and decision.chosen == "fp32" and "inf/NaN" in decision.excluded["fp16"]
    fp16_steps = {i for i, mode in enumerate(raced["model"].modes) if mode == torch.float16}
    assert len(fp16_steps) >= 2  # its skipped batches: at a backed-off scale, then unscaled
    alone = _train("fp32", Planted(overflow=fp16_steps))  # the chosen mode, those batches skipped
    assert alone["accelerator"].scaler.record.skipped_steps == len(fp16_steps)
    _assert_same(_state(raced), _state(alone))


class RaisingBf16(Bf16MixedPrecision):
    """bf16 whose step raises where ``WHERE`` says, after it has changed what it changes there: the forward
    (after drawing from the RNG), the backward (after some gradients have landed), the optimizer step (after
    the update landed: weights, moments, step counts)."""

    WHERE = "forward"

    def autocast(self) -> Any:
        return _raising_forward(super().autocast()) if self.WHERE == "forward" else super().autocast()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.WHERE == "backward":
            first = next(p for p in self._param_names)[1]
            (loss * 0 + first.sum()).backward(retain_graph=True)
            raise RuntimeError("planted: backward failed half-way")
        super().backward(loss, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        super().optimizer_step(optimizer, **kwargs)
        if self.WHERE == "step":
            raise RuntimeError("planted: step failed after the update")


class _raising_forward:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        self.inner.__exit__(*exc)
        if exc[0] is None:
            torch.rand(3)  # the forward moved the RNG
            raise RuntimeError("planted: forward failed")
        return False


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_a_race_step_whose_mode_raises_leaves_the_state_as_before(in_run_race, monkeypatch, where):
    monkeypatch.setattr(RaisingBf16, "WHERE", where)
    in_run_race(FullPrecision, RaisingBf16)  # fp32's warm-up step, then bf16's, which raises
    accelerator = Accelerator(mixed_precision="auto", verbose=False)
    model = Planted()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1)
    batches, raised, before = make_batches(4, seed=3), [], None
    for i, batch in enumerate(batches):
        if i == 1:
            before = {
                "weights": [p.detach().clone() for p in model.parameters()],
                "moments": [{k: v.clone() for k, v in s.items()} for s in optimizer.optimizer.state.values()],
                "rng": torch.random.get_rng_state(),
            }
        try:
            accelerator.backward(model(batch["input_ids"], labels=batch["labels"])["loss"])
            optimizer.step()
        except RuntimeError as err:
            raised.append((i, str(err)))
            assert all(p.grad is None for p in model.parameters())  # no half-accumulated gradient
            assert all(torch.equal(a, p) for a, p in zip(before["weights"], model.parameters()))
            moments = [{k: v.clone() for k, v in s.items()} for s in optimizer.optimizer.state.values()]
            assert all(
                a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                for a, b in zip(moments, before["moments"])
            )
            assert torch.equal(torch.random.get_rng_state(), before["rng"])
        optimizer.zero_grad()
    assert [i for i, _ in raised] == [1] and "planted" in raised[0][1]
    decision = accelerator.auto_decision  # the race went on without bf16, and decided
    assert decision is not None and decision.chosen == "fp32" and "planted" in decision.excluded["bf16"]
    assert model.modes[2:] == [None, None]  # the steps after it ran in fp32


def test_the_trainer_reports_a_race_steps_skip_at_the_scale_it_ran_with(in_run_race, tmp_path):
    in_run_race(FullPrecision, Fp16MixedPrecision)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        precision="auto",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=1000,
    )
    trainer = Trainer(Planted(overflow="fp16"), args, train_dataset=make_examples(64))
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skips = [e for e in records if e.get("event") == "skipped_step"]
    fp16_steps = [i + 1 for i, mode in enumerate(trainer.model.modes) if mode == torch.float16]
    assert [e["step"] for e in skips] == fp16_steps
    # fp16's own scale, backed off each time (never "loss scale 0": the last logged scale was None in the race)
    scales = [e["loss_scale"] for e in skips]
    # (the first at the scale the fp32 steps' gradients measured: race_step.measured_scale)
    assert scales[0] <= 65536.0 and all(s >= 1.0 for s in scales) and scales == sorted(scales, reverse=True)
    assert all(e["race_step"] for e in skips)  # logged as they ran, each a step of the race
    # the summary's count: the chosen fp32's record, once the Trainer replayed the race's batches in fp32
    # (trainer/race_rewind.py): fp32 trained every one of them, as the fp32 run does
    assert trainer.skipped_steps == 0


class _Fp16Headroom(torch.autograd.Function):
    """Identity whose backward needs 4x room in fp16: the gradient reaching it (the loss scale, times 1) is
    non-finite once 4x it overflows fp16, as at torch's default scale 2^16, not at 2^13 or below."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad + 0.0 * (grad * 4).half().float()  # inf * 0: NaN where 4x overflows fp16


class ScaleSensitive(Planted):
    """The tiny LM whose loss is 8x (gradients up to ~1 and more: a measured scale of 2^12 at most) through
    :class:`_Fp16Headroom`."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(input_ids, labels)
        return {"loss": _Fp16Headroom.apply(out["loss"] * 8)}


def test_fp16s_first_race_step_starts_at_a_measured_scale_and_skips_no_batch(in_run_race):
    in_run_race(FullPrecision, Fp16MixedPrecision)
    raced = _train("auto", ScaleSensitive())
    fp16_steps = [i for i, mode in enumerate(raced["model"].modes) if mode == torch.float16]
    assert len(fp16_steps) >= 3  # fp16 raced, every step finite: at 2^16 its first one overflowed
    assert raced["accelerator"].scaler.record.skipped_steps == 0
    decision = raced["accelerator"].auto_decision
    assert decision is not None and "fp16" not in decision.excluded
    assert race_step.measured_scale(1.0, 65536.0) == 2.0**12  # the largest 2^k with 8x headroom below 65504
    assert race_step.measured_scale(0.0, 65536.0) == 65536.0  # nothing measured: the scaler's own


def test_a_mode_that_raises_in_a_timed_round_leaves_the_race_and_cannot_win():
    from mixprec.precision.race import Failed, decide_steps

    steps = decide_steps(["fp32", "bf16", "fp16"], device="cpu", threads=1, in_run=True)
    seconds = {"fp32": 0.030, "bf16": 0.020, "fp16": 0.010}  # fp16 the fastest, until it raises
    trials, name = [], next(steps)[0]
    try:
        while True:
            trials.append(name)
            raised = name == "fp16" and trials.count("fp16") == 2  # its first timed round
            outcome = Failed("its training step raised RuntimeError: boom") if raised else True
            name = steps.send((outcome, seconds[name]))[0]
    except StopIteration as stop:
        decision = stop.value
    assert "boom" in decision.excluded["fp16"] and decision.chosen == "bf16"
    assert trials.count("fp16") == 2 and "fp16" not in decision.step_seconds
