"""precision="bf16-pure" (and -kahan): bf16 parameters, gradients and Adam states; small updates kept by
stochastic rounding or Kahan summation, where round-to-nearest loses them (the planted case)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import make_batches, make_tiny_lm
from mixprec import Accelerator
from mixprec.bench.footprint import training_state_bytes
from mixprec.optim import Bf16AdamW, stochastic_round_
from mixprec.precision.pure import PureBf16KahanPrecision, PureBf16Precision
from mixprec.precision.registry import resolve_precision


def _small_updates_to_large_weights(rounding: str, steps: int = 100) -> torch.Tensor:
    # Weights at 1.0, where a bf16 ulp is 2^-7 = 0.0078; Adam's normalised step is lr = 1e-4 per step, under
    # half an ulp: round-to-nearest writes 1.0 back every time. fp32 would reach 1 - 100 * 1e-4 = 0.99.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = Bf16AdamW([w], lr=1e-4, weight_decay=0.0, rounding=rounding)
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
    return w.detach().float()


def test_round_to_nearest_loses_every_small_update():
    assert torch.equal(_small_updates_to_large_weights("nearest"), torch.ones(4096))


def test_kahan_summation_keeps_them_to_within_one_bf16_ulp():
    w = _small_updates_to_large_weights("kahan")
    assert (w - 0.99).abs().max() <= 2.0**-8  # bf16 ulp at 0.99 is 2^-8


def test_stochastic_rounding_keeps_them_on_average():
    w = _small_updates_to_large_weights("stochastic")
    assert abs(float(w.mean()) - 0.99) < 5e-4  # unbiased: the mean over 4096 weights lands on fp32's value


def test_stochastic_rounding_is_exact_on_bf16_values_and_unbiased_between():
    exact = torch.randn(1000).bfloat16().float()
    out = torch.empty(1000, dtype=torch.bfloat16)
    stochastic_round_(out, exact)
    assert torch.equal(out.float(), exact)
    third = torch.full((100_000,), 1.0 + 2.0**-7 / 3)  # a third of the way from 1.0 to the next bf16 value
    out = torch.empty(100_000, dtype=torch.bfloat16)
    stochastic_round_(out, third)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float((out.float() == 1.0 + 2.0**-7).float().mean()) - 1 / 3) < 0.01
    neg = torch.empty(100_000, dtype=torch.bfloat16)
    stochastic_round_(neg, -third)
    assert abs(float(neg.float().mean()) + float(third[0])) < 1e-4


def _train(name: str, steps: int = 60, lr: float = 1e-2) -> tuple[Accelerator, torch.nn.Module, Any, float]:
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=name, verbose=False)
    model = make_tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.99**s)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    losses = []
    for batch in make_batches(steps):
        loss = model(batch["input_ids"], labels=batch["labels"]).loss
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return acc, model, optimizer, sum(losses[-10:]) / 10


def test_pure_bf16_keeps_everything_in_bf16_at_8_bytes_per_parameter():
    acc, model, optimizer, _ = _train("bf16-pure", steps=3)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the fp32 copy is not kept
    assert isinstance(optimizer.optimizer, Bf16AdamW)
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert training_state_bytes(model, optimizer)["per_param"] == pytest.approx(8.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.99**3)  # the scheduler still steers it
    assert "stochastic rounding" in acc.precision.reason and acc.precision.describe()["param_dtype"] == "bfloat16"


def test_kahan_adds_two_bytes_and_fp32_autocast_holds_sixteen():
    _, model, optimizer, _ = _train("bf16-pure-kahan", steps=2)
    assert training_state_bytes(model, optimizer)["per_param"] == pytest.approx(10.0)
    _, model, optimizer, _ = _train("bf16", steps=2)
    assert training_state_bytes(model, optimizer)["per_param"] == pytest.approx(16.0)


def test_pure_bf16_trains_as_well_as_fp32_and_bf16_autocast_on_the_tiny_task():
    # mid-training (the task is learnt to ~0 loss later, where relative differences say nothing)
    *_, fp32 = _train("fp32", steps=20, lr=3e-3)
    *_, mixed = _train("bf16", steps=20, lr=3e-3)
    *_, pure = _train("bf16-pure", steps=20, lr=3e-3)
    *_, kahan = _train("bf16-pure-kahan", steps=20, lr=3e-3)
    assert mixed == pytest.approx(fp32, rel=0.01)
    assert pure == pytest.approx(fp32, rel=0.01) and kahan == pytest.approx(fp32, rel=0.01)


def test_names_and_refusals():
    assert type(resolve_precision("bf16-true", "cpu")) is PureBf16Precision
    assert type(resolve_precision("true-bf16", "cpu")) is PureBf16Precision
    assert type(resolve_precision("bf16-pure-kahan", "cpu")) is PureBf16KahanPrecision
    acc = Accelerator(mixed_precision="bf16-pure", verbose=False)
    model = acc.prepare(make_tiny_lm())
    with pytest.raises(ValueError, match=r"got SGD: pass torch.optim.AdamW or Adam, or use precision='bf16'"):
        acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_checkpoint_resumes_pure_bf16_exactly(tmp_path):
    # The stochastic rounding draws from torch's generator, which the state saves: a resumed run rounds alike.
    def run(save_at: int | None, load: bool, steps: int) -> torch.nn.Module:
        torch.manual_seed(0)
        acc = Accelerator(mixed_precision="bf16-pure", verbose=False)
        model = make_tiny_lm()
        model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        batches = make_batches(steps)
        start = 0
        if load:
            acc.load_state(tmp_path / "state")
            start = save_at
        for i, batch in enumerate(batches[start:], start):
            acc.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
            optimizer.step()
            optimizer.zero_grad()
            if save_at is not None and not load and i + 1 == save_at:
                acc.save_state(tmp_path / "state")
        return model

    straight = run(None, False, 6)
    run(3, False, 3)
    resumed = run(3, True, 6)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("decoupled", [True, False])
def test_on_fp32_weights_the_update_is_torchs_adamw_or_adam(decoupled, monkeypatch):
    monkeypatch.setattr("mixprec.optim.adamw_step._CHUNK", 4096)  # several chunks, the last one partial
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(3, 5000))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Bf16AdamW([a], lr=1e-2, weight_decay=0.1, decoupled=decoupled)
    theirs = (torch.optim.AdamW if decoupled else torch.optim.Adam)([b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_pure_bf16_with_8bit_adam_states_holds_about_6_bytes_per_parameter():
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit

    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="bf16-pure", verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))  # blocks of 256 quantise
    model, optimizer = acc.prepare(model, AdamW8bit(model.parameters(), lr=1e-3))
    assert optimizer.optimizer.bf16_stochastic_round is True
    acc.backward(model(torch.randn(4, 256)).float().pow(2).mean())
    optimizer.step()
    per_param = training_state_bytes(model, optimizer)["per_param"]
    assert per_param < 6.1  # 2 (bf16 weight) + 2 (bf16 grad) + ~2 (two 8-bit moments and their block scales)
    # the run's line says the states as they are (it said "Adam states in bf16 (8 bytes per parameter)")
    assert "in bf16, AdamW8bit's quantised Adam states; updates with stochastic rounding" in acc.precision.reason
    with pytest.raises(ValueError, match="Kahan"):
        Accelerator(mixed_precision="bf16-pure-kahan", verbose=False).prepare(AdamW8bit(model.parameters()))
