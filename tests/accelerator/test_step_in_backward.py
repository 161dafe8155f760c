"""The optimizer step in backward (accelerator/step_in_backward.py): the same updates as a step after backward,
no gradient outliving its own update, exact checkpoints, and every combination it cannot honour refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_batches, make_tiny_lm
from mixprec import Accelerator, Trainer, TrainingArguments


def train(precision: str, step_in_backward: bool, steps: int = 6, model=None, live: list[int] | None = None):
    accelerator = Accelerator(mixed_precision=precision, step_in_backward=step_in_backward, verbose=False)
    model = model if model is not None else make_tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if live is not None:  # count the gradients alive each time the optimizer runs
        inner = optimizer.optimizer
        original = inner.step

        def counting_step(*args, **kwargs):
            live.append(sum(p.grad is not None for p in model.parameters()))
            return original(*args, **kwargs)

        inner.step = counting_step
    losses = []
    for batch in make_batches(steps):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator, model, optimizer, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_same_weights_and_optimizer_state_as_stepping_after_backward(precision: str) -> None:
    _, after, opt_after, _ = train(precision, False)
    _, during, opt_during, _ = train(precision, True)
    for a, b in zip(after.parameters(), during.parameters()):
        assert torch.equal(a, b)  # bit for bit: the same AdamW arithmetic, the scheduler's lr at each step
    for key, state in opt_after.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, opt_during.state_dict()["state"][key][name]), name


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # the counting wrapper
def test_no_gradient_outlives_its_update() -> None:
    live: list[int] = []
    _, model, _, _ = train("fp32", True, steps=3, live=live)
    params = len(list(model.parameters()))
    assert live == [1] * (3 * params)  # each call saw only the parameter it updates
    assert all(p.grad is None for p in model.parameters())
    stepped_after: list[int] = []
    train("fp32", False, steps=1, live=stepped_after)
    assert stepped_after == [params]  # the ordinary step holds them all


def test_bf16_pure_learns_as_well_stepping_in_backward() -> None:
    # stochastic rounding draws other random bits per parameter, so the runs differ bit-wise, not in quality
    *_, plain = train("bf16-pure", False, steps=20)
    *_, during = train("bf16-pure", True, steps=20)
    assert during[-1] < 0.8 * during[0]
    assert abs(sum(during[-5:]) - sum(plain[-5:])) / sum(plain[-5:]) < 0.02


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_checkpoint_resumes_bit_exact(tmp_path: Path, precision: str) -> None:
    # with a schedule: the hooks stepped with the learning rate of the groups load_state_dict had replaced
    def run(resume: bool, save: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        accelerator = Accelerator(mixed_precision=precision, step_in_backward=True, verbose=False)
        model = make_tiny_lm()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
        batches = make_batches(6)
        start = 0
        if resume:
            accelerator.load_state(str(tmp_path / "ckpt"))
            start = 3
        for i, batch in enumerate(batches[start:], start):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            if save and i == 2:
                accelerator.save_state(str(tmp_path / "ckpt"))
        return model

    whole = run(resume=False, save=True)
    resumed = run(resume=True, save=False)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_free_memory_unhooks_the_parameters() -> None:
    accelerator, model, optimizer, _ = train("fp32", True, steps=1)
    accelerator.free_memory()
    before = [p.detach().clone() for p in model.parameters()]
    model(**make_batches(1)[0]).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # kept: nothing steps them any more
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_auto_races_without_fp16_and_its_trials_step_no_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    # the default precision with the step in backward was refused ("auto may choose fp16"): auto now leaves the
    # modes that scale the loss out of its race, saying why, and a trial's backward (raced aside) updates nothing,
    # so the run is bit for bit the one that named the winner
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "aside")
    accelerator, model, optimizer, _ = train("auto", True)
    decision = accelerator.auto_decision
    assert decision.source == "measured" and "fp16" not in decision.step_seconds
    assert decision.excluded["fp16"].startswith("step_in_backward=True: its loss scaling needs every gradient")
    _, named, named_optimizer, _ = train(accelerator.mixed_precision, True)
    for a, b in zip(model.parameters(), named.parameters()):
        assert torch.equal(a, b)
    assert optimizer.state_dict()["state"].keys() == named_optimizer.state_dict()["state"].keys()


def test_the_trainer_under_auto_steps_in_backward_and_its_race_replays_to_the_winners_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # raced as the run's steps (each updating in backward), then replayed in the winner: the named run's weights
    monkeypatch.setenv("MIXPREC_AUTO_RACE", "in-run")

    def trainer(precision: str) -> Trainer:
        args = TrainingArguments(
            output_dir=str(tmp_path / precision),
            precision=precision,
            step_in_backward=True,
            max_grad_norm=0,
            max_steps=40,
            per_device_train_batch_size=8,
            learning_rate=1e-2,
            report_to="none",
            disable_tqdm=True,
            save_plots=False,
            use_cpu=True,
        )
        result = Trainer(make_tiny_lm(), args, train_dataset=[b for batch in make_batches(40) for b in _rows(batch)])
        result.train()
        return result

    auto = trainer("auto")
    decision = auto.accelerator.auto_decision
    assert (
        decision.in_run_steps > 0 and decision.replayed_steps == decision.in_run_steps and "fp16" in decision.excluded
    )
    named = trainer(auto.accelerator.mixed_precision)
    for a, b in zip(auto.model.parameters(), named.model.parameters()):
        assert torch.equal(a, b)


def _rows(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]


def test_what_it_cannot_honour_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="fp16's loss scaling skips a step"):
        Accelerator(mixed_precision="fp16", step_in_backward=True, verbose=False)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2, step_in_backward=True"):
        Accelerator(gradient_accumulation_steps=2, step_in_backward=True, verbose=False)
    accelerator, model, _, _ = train("fp32", True, steps=1)
    with pytest.raises(ValueError, match=r"clip_grad_norm_\(\) with step_in_backward=True: gradient clipping"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match=r"clip_grad_value_\(\) with step_in_backward=True"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 with step_in_backward=True"):
        accelerator.gradient_accumulation_steps = 4


def test_training_arguments_refuse_clipping_accumulation_and_fp16(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"step_in_backward=True\): with max_grad_norm=1.0: gradient clipping"):
        TrainingArguments(output_dir=str(tmp_path), step_in_backward=True)  # HF's default clips at 1.0
    with pytest.raises(ValueError, match="with gradient_accumulation_steps=2"):
        TrainingArguments(
            output_dir=str(tmp_path), step_in_backward=True, max_grad_norm=0, gradient_accumulation_steps=2
        )
    with pytest.raises(ValueError, match="with precision='fp16'"):
        TrainingArguments(output_dir=str(tmp_path), step_in_backward=True, max_grad_norm=0, fp16=True)


def test_trainer_trains_stepping_in_backward(tmp_path: Path) -> None:
    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.rows = [{k: v[i] for k, v in b.items()} for b in make_batches(8) for i in range(8)]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return self.rows[i]

    args = TrainingArguments(
        output_dir=str(tmp_path),
        precision="bf16-pure",
        step_in_backward=True,
        max_grad_norm=0,
        learning_rate=1e-2,
        num_train_epochs=2,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
    )
    trainer = Trainer(model=make_tiny_lm(), args=args, train_dataset=Rows())
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 16 and losses[-1] < 0.8 * losses[0]
    assert all(p.grad is None for p in trainer.model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_a_non_finite_gradient_is_never_applied_and_the_step_counts_as_skipped(precision: str) -> None:
    accelerator = Accelerator(mixed_precision=precision, step_in_backward=True, verbose=False)
    model = make_tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batch = make_batches(1)[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = model.hidden.weight.register_hook(lambda g: torch.full_like(g, float("inf")))  # planted overflow
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    scheduler.step()
    handle.remove()
    assert torch.equal(model.hidden.weight, before["hidden.weight"])  # the inf gradient was not applied
    assert torch.isfinite(torch.cat([p.detach().float().flatten() for p in model.parameters()])).all()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() == [1e-2]  # the schedule held, as for any skipped step
    loss = model(**batch).loss * float("nan")  # a NaN loss: every gradient NaN, nothing applied
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    accelerator.backward(loss)
    optimizer.step()
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())
    accelerator.backward(model(**batch).loss)  # and a finite step after it applies again
    optimizer.step()
    assert not optimizer.step_was_skipped
    assert not torch.equal(model.hidden.weight, state["hidden.weight"])
