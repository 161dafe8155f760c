"""scaling.guard: in bf16 and fp32 a non-finite gradient skips the step as fp16's scaler does (before, one inf
made every parameter NaN and the run "completed")."""

from __future__ import annotations

import pytest
import torch

from mixprec import Accelerator, ConsecutiveSkipsError
from mixprec.scaling.guard import NonFiniteGuard

MODES = ["fp32", "bf16", "bf16-pure"]


def _setup(precision: str, **scaler_kwargs):
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=precision, verbose=False, scaler_kwargs=scaler_kwargs or None)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    return acc, *acc.prepare(model, optimizer, scheduler)


def _step(acc, model, optimizer, scheduler, x):
    acc.backward(model(x).float().pow(2).mean())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("precision", MODES)
def test_an_inf_input_skips_the_step_and_holds_the_lr(precision):
    acc, model, optimizer, scheduler = _setup(precision)
    _step(acc, model, optimizer, scheduler, torch.randn(8, 4))
    before = [p.detach().clone() for p in model.parameters()]
    lr = optimizer.param_groups[0]["lr"]
    _step(acc, model, optimizer, scheduler, torch.full((8, 4), float("inf")))
    assert acc.optimizer_step_was_skipped and acc.scaler.record.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # no NaN reached the weights
    assert optimizer.param_groups[0]["lr"] == lr  # the schedule held still
    _step(acc, model, optimizer, scheduler, torch.randn(8, 4))
    assert not acc.optimizer_step_was_skipped and all(torch.isfinite(p).all() for p in model.parameters())
    assert not acc.scaler.is_enabled() and acc.scaler.get_scale() == 1.0  # still no loss scaling


@pytest.mark.parametrize("precision", MODES)
def test_too_many_skips_in_a_row_stop_with_the_names(precision):
    acc, model, optimizer, scheduler = _setup(precision, max_consecutive_skips=3)
    with pytest.raises(ConsecutiveSkipsError, match=r"3 optimizer steps in a row.*Non-finite gradients in: 0.weight"):
        for _ in range(3):
            _step(acc, model, optimizer, scheduler, torch.full((8, 4), float("nan")))


def test_the_guard_is_the_scaler_of_every_mode_without_loss_scaling_and_saves_its_record(tmp_path):
    acc, model, optimizer, scheduler = _setup("bf16")
    assert isinstance(acc.scaler, NonFiniteGuard)
    _step(acc, model, optimizer, scheduler, torch.full((8, 4), float("inf")))
    acc.save_state(tmp_path / "s")
    again, *objects = _setup("bf16")
    again.load_state(tmp_path / "s")
    assert again.scaler.record.skipped_steps == 1 and again.scaler.record.steps == 1
