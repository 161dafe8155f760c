"""A prepared LR scheduler advances as accelerate's does (issue 22: accelerate's tests/test_scheduler.py):
with its optimizer (not while accumulating, not after a skipped step), ``num_processes`` times per optimizer
step unless ``split_batches`` (or a schedule counted in optimizer steps, as mixprec's Trainer sizes it); or,
with ``step_scheduler_with_optimizer=False``, whenever the script steps it."""

from __future__ import annotations

import pytest
import torch

from mixprec import Accelerator
from mixprec.accelerator.config import AcceleratorConfig, scheduler_rule

pytestmark = pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")


def _prepared(**kwargs):
    acc = Accelerator(verbose=False, **kwargs)
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    return (acc, *acc.prepare(model, optimizer, scheduler))


@pytest.mark.parametrize("kwargs", [{}, {"split_batches": True}])
def test_one_process_steps_once_per_optimizer_step_and_not_after_a_skipped_one(kwargs) -> None:
    _, _, optimizer, scheduler = _prepared(**kwargs)
    optimizer._is_overflow = False  # accelerate's name for "the step was skipped", which its tests set
    scheduler.step()
    assert scheduler.get_last_lr() == [0.9]
    optimizer._is_overflow = True
    assert optimizer.step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr() == [0.9]


def test_without_step_scheduler_with_optimizer_every_step_advances() -> None:
    # a schedule the script steps per epoch or on a metric: neither accumulation nor a skipped step holds it back
    acc, model, optimizer, scheduler = _prepared(step_scheduler_with_optimizer=False, gradient_accumulation_steps=2)
    optimizer._is_overflow = True
    scheduler.step()
    with acc.accumulate(model):
        assert not acc.sync_gradients
        scheduler.step()
    assert scheduler.get_last_lr() == [0.8]


def test_several_processes_advance_num_processes_times_unless_the_schedule_counts_optimizer_steps() -> None:
    assert scheduler_rule(AcceleratorConfig(), 2) == {"with_optimizer": True, "per_step": 2}
    assert scheduler_rule(AcceleratorConfig(scheduler_counts_optimizer_steps=True), 2)["per_step"] == 1
    assert scheduler_rule(AcceleratorConfig(step_scheduler_with_optimizer=False), 1)["with_optimizer"] is False
    # mixprec's DataLoaders cannot split one batch over processes: refused by name, not silently ignored
    with pytest.raises(ValueError, match=r"split_batches=True\) with 2 processes.*per-process batch size"):
        scheduler_rule(AcceleratorConfig(split_batches=True), 2)


def test_one_cycle_stops_at_its_last_step_instead_of_raising() -> None:
    from mixprec.accelerator.prepared import PreparedScheduler

    acc, _, optimizer, _ = _prepared()
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=3)
    scheduler = PreparedScheduler(one_cycle, [optimizer], acc._gradients, per_step=2)  # as 2 processes would
    for _ in range(3):  # 6 advances asked of a 3-step cycle (a last batch without drop_last)
        scheduler.step()
    assert one_cycle.last_epoch == 3
