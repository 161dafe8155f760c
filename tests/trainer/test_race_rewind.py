"""auto's in-run race rewound by the Trainer (mixprec.trainer.race_rewind, issue 34).

The in-run race trains the run's first steps each in the mode it times next. Once it decides, the Trainer puts
the run back as the race found it and trains the race's batches again in the chosen mode, so the run ends
exactly as one that named that mode: weights, optimizer moments, LR schedule, step record and RNG. The model
has dropout, so a rewind that missed the RNG would show in the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import race_in_run
from mixprec import Trainer, TrainingArguments
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import Bf16MixedPrecision, Fp16MixedPrecision
from mixprec.trainer import race_rewind
from planted_precisions import SleepyFp32
from trainer_utils import DropLM, assert_bit_identical, flat_params, make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

STEPS = 40


@pytest.fixture
def in_run(monkeypatch: pytest.MonkeyPatch) -> Any:
    """auto races in-run among the given candidates, afresh (no cache, no prefilter, no per-op policy)."""
    return race_in_run(monkeypatch)


def _train(
    precision: str,
    folder: Path,
    model: torch.nn.Module | None = None,
    resume: str | None = None,
    compute_loss_func: Any = None,
    **kwargs: Any,
) -> Trainer:
    settings = {"save_strategy": "no", "max_steps": STEPS, "per_device_train_batch_size": 4, **kwargs}
    args = TrainingArguments(
        output_dir=str(folder),
        disable_tqdm=True,
        save_plots=False,
        precision=precision,
        logging_steps=1000,
        learning_rate=1e-2,
        **settings,
    )
    model = model if model is not None else make_model()
    trainer = Trainer(model, args, train_dataset=make_examples(64), compute_loss_func=compute_loss_func)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _end_state(trainer: Trainer) -> dict[str, Any]:
    """What a run ends with: weights, optimizer moments and step counts, the schedule, the record, the RNG."""
    moments = trainer.optimizer.state_dict()["state"]
    record = trainer.accelerator.scaler.record
    return {
        "weights": flat_params(trainer.model),
        "moments": {f"{i}.{k}": v.clone() for i, s in moments.items() for k, v in s.items()},
        "lr": trainer.lr_scheduler.get_last_lr(),
        "record": (record.steps, record.skipped_steps, [e.skipped for e in record.history]),
        "rng": torch.random.get_rng_state(),
    }


def _assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_bit_identical(got["weights"], want["weights"])
    assert_bit_identical(got["moments"], want["moments"])
    assert got["lr"] == want["lr"] and got["record"] == want["record"]
    assert torch.equal(got["rng"], want["rng"])


def _run_lines(caplog) -> list[str]:
    """The run's line once decided (the announcement, logger "mixprec"), as often as it was said."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mixprec: bf16 on cpu")]


def test_an_in_run_race_ends_bit_identical_to_the_chosen_mode_asked_by_name(in_run, tmp_path, caplog):
    in_run(SleepyFp32, Bf16MixedPrecision)  # fp32's step burns 30 ms: bf16 wins, after steps in both modes
    with caplog.at_level(logging.INFO, logger="mixprec"):
        raced = _train("auto", tmp_path / "auto", gradient_accumulation_steps=2)
    # the run's line is said once, after the replay, with the race's whole cost (it said the race's alone first)
    (line,) = _run_lines(caplog)
    assert "took them again in bf16" in line
    decision = raced.accelerator.auto_decision
    assert decision.chosen == "bf16" and 0 < decision.in_run_steps < STEPS
    named = _train(decision.chosen, tmp_path / "named", gradient_accumulation_steps=2)
    _assert_same_run(_end_state(raced), _end_state(named))
    assert decision.replayed_steps == decision.in_run_steps and decision.replay_seconds > 0
    # the summary says the race's steps were taken again, and counts their time in the race's cost
    summary = json.loads((tmp_path / "auto" / "train_summary.json").read_text())
    assert summary["auto_precision"]["replayed_steps"] == decision.in_run_steps
    assert summary["global_step"] == STEPS  # the replayed steps are not counted twice
    assert f"took them again in bf16 ({decision.in_run_steps} steps" in summary["precision_reason"]
    assert summary["time"]["run_seconds"]["race"] == pytest.approx(
        decision.op_timing_seconds + decision.cost_seconds, abs=1e-3
    )
    assert decision.cost_seconds >= decision.replay_seconds


def test_a_race_replayed_with_compute_loss_func_hands_each_step_its_windows_items_again(in_run, tmp_path):
    # the replay keeps each micro-batch's window count (loss_items.py): a replay without it divided by None
    counts: list[int] = []

    def summed(outputs, labels, num_items_in_batch=None):
        counts.append(int(num_items_in_batch))
        logits = outputs.logits.float().reshape(-1, outputs.logits.shape[-1])
        return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum") / num_items_in_batch

    in_run(SleepyFp32, Bf16MixedPrecision)
    raced = _train("auto", tmp_path / "auto", compute_loss_func=summed, gradient_accumulation_steps=2)
    decision = raced.accelerator.auto_decision
    assert decision.replayed_steps == decision.in_run_steps > 0
    assert len(counts) == 2 * (STEPS + decision.in_run_steps)  # every micro-batch, the replayed ones again
    counts.clear()
    named = _train(decision.chosen, tmp_path / "named", compute_loss_func=summed, gradient_accumulation_steps=2)
    _assert_same_run(_end_state(raced), _end_state(named))


class Fp16Overflow(DropLM):
    """DropLM whose loss is inf under fp16 autocast (activations past 65504 in a real model): fp16's race
    steps are skipped batches and fp16 leaves the race."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        loss = super().forward(input_ids, labels).loss
        fp16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        return {"loss": loss * float("inf") if fp16 else loss}


def test_a_race_step_that_overflowed_is_replayed_in_the_chosen_mode(in_run, tmp_path):
    in_run(FullPrecision, Fp16MixedPrecision)  # fp16 overflows at every scale: excluded, fp32 chosen
    torch.manual_seed(0)
    raced = _train("auto", tmp_path / "auto", model=Fp16Overflow())
    decision = raced.accelerator.auto_decision
    assert decision.chosen == "fp32" and "inf/NaN" in decision.excluded["fp16"]
    # what the user gets: the fp32 run, every batch trained (fp32 takes the fp16 steps' batches again)
    torch.manual_seed(0)
    named = _train("fp32", tmp_path / "named", model=Fp16Overflow())
    _assert_same_run(_end_state(raced), _end_state(named))
    assert raced.skipped_steps == 0
    records = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    skips = [e for e in records if e.get("event") == "skipped_step"]
    assert len(skips) >= 2 and all(e["race_step"] for e in skips)  # the race's fp16 steps, logged as they ran


def test_a_resume_from_a_checkpoint_after_the_race_equals_the_uninterrupted_run(in_run, tmp_path):
    in_run(SleepyFp32, Bf16MixedPrecision)
    saving = {"save_strategy": "steps", "save_steps": 30}
    whole = _train("auto", tmp_path / "whole", **saving)
    decision = whole.accelerator.auto_decision
    assert decision.chosen == "bf16" and decision.in_run_steps < 30  # the checkpoint comes after the race
    resumed = _train("auto", tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-30"), **saving)
    assert resumed.accelerator.auto_decision.source == "checkpoint"
    _assert_same_run(_end_state(resumed), _end_state(whole))
    named = _train("bf16", tmp_path / "named", **saving)  # and both are the chosen mode's run
    _assert_same_run(_end_state(whole), _end_state(named))


def test_a_race_still_running_when_the_epoch_ends_keeps_its_steps_and_says_so(in_run, tmp_path, caplog):
    # the next epoch's order draws from the RNG, which a rewind would move: the race's steps stay as they ran
    in_run(SleepyFp32, Bf16MixedPrecision)
    with caplog.at_level("WARNING", logger="mixprec.trainer"):
        raced = _train("auto", tmp_path / "auto", max_steps=-1, num_train_epochs=3, per_device_train_batch_size=16)
    decision = raced.accelerator.auto_decision  # 4 steps an epoch: decided in a later epoch, not replayed
    assert decision.chosen == "bf16" and decision.in_run_steps > 4 and decision.replayed_steps == 0
    assert "the epoch or the run ended before the race decided" in caplog.text
    assert raced.state.global_step == 12


def test_a_race_longer_than_its_share_of_a_short_run_keeps_its_steps_and_says_why(
    in_run, tmp_path, monkeypatch, caplog
):
    """On issue 36's 60-step example the replay of 10 race steps cost 17% of the run (1.20x bf16's time): a race
    of more than REPLAY_SHARE of the run keeps its steps as they ran; one within it is replayed."""
    monkeypatch.delenv("MIXPREC_AUTO_REPLAY")  # the suite replays every race (conftest.py): a user's default here
    in_run(SleepyFp32, Bf16MixedPrecision)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        short = _train("auto", tmp_path / "short")
    decision = short.accelerator.auto_decision
    assert decision.chosen == "bf16" and decision.in_run_steps > race_rewind.REPLAY_SHARE * STEPS
    assert decision.replayed_steps == 0 and "took them again" not in decision.explain()
    assert f"the race's {decision.in_run_steps} steps stay as they ran" in caplog.text
    assert len(_run_lines(caplog)) == 1  # nothing replayed: the line as the race left it, said once
    named = _end_state(_train("bf16", tmp_path / "named"))
    kept = flat_params(short.model)  # the race's fp32 steps are in it
    assert any(not torch.equal(kept[k], named["weights"][k]) for k in kept)
    monkeypatch.setattr(race_rewind, "REPLAY_SHARE", 1.0)  # a run long enough for its race: replayed
    replayed = _train("auto", tmp_path / "long")
    assert replayed.accelerator.auto_decision.replayed_steps == replayed.accelerator.auto_decision.in_run_steps
    _assert_same_run(_end_state(replayed), named)
