"""fp32 master copies of trainable fp16/bf16 parameters (mixprec.precision.master_weights), at the Accelerator:
a half-precision base stays as it is, what trains learns in fp32, in every precision mode."""

from __future__ import annotations

import pytest
import torch

from conftest import SEQ, VOCAB, make_tiny_lm
from mixprec import Accelerator


def half_base(dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.nn.Module:
    """The tiny LM loaded in ``dtype`` with only its head trainable (a frozen base under a trainable part)."""
    torch.manual_seed(seed)
    model = make_tiny_lm().to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
    return model


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": (ids + 1) % VOCAB}


def train(accelerator: Accelerator, model: torch.nn.Module, optimizer, steps: int, first: int = 0) -> list[float]:
    losses = []
    for i in range(first, first + steps):
        loss = model(**batch(i % 4)).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class TinyGrad(torch.nn.Module):
    """A trainable fp16 weight of 1e-3 whose gradient is 1e-8: below fp16's smallest subnormal (6e-8)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((16,), 1e-3, dtype=torch.float16))
        self.frozen = torch.nn.Parameter(torch.ones(16, dtype=torch.float16), requires_grad=False)

    def forward(self) -> torch.Tensor:
        return (self.w * self.frozen * torch.full((16,), 1e-8)).sum()  # d/dw = 1e-8, in fp32 until w.grad


def test_planted_tiny_fp16_gradient_learns_through_its_fp32_master() -> None:
    """Each update (lr * 1e-8 = 1e-7) is under half an fp16 ulp at 1e-3 (4.8e-7), so stepping the fp16
    weight itself would never move it, and the unscaled gradient would be 0 in fp16. Through the scaled
    fp16 gradient and the fp32 master, 20 steps move it by 2e-6 (about two fp16 ulps)."""
    model = TinyGrad()
    w0 = model.w.detach().clone()
    lr, grad = 1.0, 1e-8
    assert torch.equal((w0.float() - lr * 10 * grad).half(), w0)  # the planted case: fp16 alone loses it
    assert torch.tensor(grad).half().item() == 0.0  # and the unscaled gradient underflows
    accelerator = Accelerator(mixed_precision="fp16", verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr * 10))
    for _ in range(20):
        accelerator.backward(model())
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.scaler.record.skipped_steps == 0
    master = optimizer.param_groups[0]["params"][0]
    assert master.dtype == torch.float32
    expected = w0.float() - 20 * 10 * lr * grad
    torch.testing.assert_close(master.detach(), expected, rtol=1e-4, atol=0)  # fp16-exact gradient 1e-8*2^16
    assert model.w.dtype == torch.float16
    assert torch.equal(model.w.detach(), master.detach().half())  # refreshed from the master
    assert (model.w < w0).all()  # it learned
    assert torch.equal(model.frozen, torch.ones(16, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "no", "auto"])
def test_frozen_base_stays_and_trainable_part_trains_in_fp32(precision: str, dtype: torch.dtype) -> None:
    model = half_base(dtype)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    accelerator = Accelerator(mixed_precision=precision, verbose=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = train(accelerator, model, optimizer, 12)
    assert sum(losses[-3:]) < sum(losses[:3])
    for name, p in model.named_parameters():
        assert p.dtype == dtype, name  # the model keeps the dtypes its author gave it
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"frozen {name} changed"
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    assert {m.dtype for m in masters} == {torch.float32}
    assert {t.dtype for s in optimizer.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    assert torch.equal(model.head.weight, masters[0].detach().to(dtype))


def test_bf16_pure_keeps_a_frozen_fp16_base_and_makes_the_rest_bf16() -> None:
    model = half_base(torch.float16)
    model.head.float()  # the trainable part in fp32, as peft leaves adapters
    before = model.embed.weight.detach().clone()
    accelerator = Accelerator(mixed_precision="bf16-pure", verbose=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = train(accelerator, model, optimizer, 8)
    assert losses[-1] < losses[0]
    assert model.embed.weight.dtype == torch.float16 and torch.equal(model.embed.weight, before)
    assert model.head.weight.dtype == torch.bfloat16


def test_fp8_trains_the_fp32_master_of_a_half_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchao")
    monkeypatch.setenv("MIXPREC_FP8_EMULATE", "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).half()
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    accelerator = Accelerator(mixed_precision="fp8", verbose=False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert accelerator.precision.describe()["fp8_layers"] == ["0", "2"]
    assert model[0].weight.dtype == torch.float16 and torch.equal(model[0].weight, frozen)
    assert model[2].weight.dtype == torch.float16


def test_clipping_sees_the_true_gradient_of_a_master() -> None:
    """The norm clip_grad_norm_ returns is the unscaled fp32 gradient's, the same as an fp32 copy's."""
    reference = half_base().float()
    loss = reference(**batch()).loss
    loss.backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in reference.head.parameters()]))
    model = half_base()
    accelerator = Accelerator(mixed_precision="fp16", verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
    accelerator.backward(model(**batch()).loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=0)  # fp16 compute of the same weights
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    clipped = torch.linalg.vector_norm(torch.cat([m.grad.flatten() for m in masters]))
    torch.testing.assert_close(clipped, torch.tensor(1e-3), rtol=1e-3, atol=0)


def test_an_overflowing_step_leaves_master_and_model_untouched() -> None:
    model = half_base()
    accelerator = Accelerator(mixed_precision="fp16", verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
    before = model.head.weight.detach().clone()
    accelerator.backward(model(**batch()).loss * float("inf"))
    optimizer.step()
    assert optimizer.step_was_skipped
    assert torch.equal(model.head.weight, before)
    assert torch.equal(optimizer.param_groups[0]["params"][0].detach().half(), before)


def test_save_and_load_state_resume_exactly_with_the_masters_bits(tmp_path) -> None:
    def run() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
        model = half_base()
        accelerator = Accelerator(mixed_precision="fp16", verbose=False)
        optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
        return accelerator, *accelerator.prepare(model, optimizer)

    accelerator, model, optimizer = run()
    train(accelerator, model, optimizer, 3)
    accelerator.save_state(tmp_path / "state")
    straight = train(accelerator, model, optimizer, 3, first=3)
    accelerator, resumed_model, resumed = run()
    train(accelerator, resumed_model, resumed, 1, first=7)  # wander off first: the load must undo it
    accelerator.load_state(tmp_path / "state")
    again = train(accelerator, resumed_model, resumed, 3, first=3)
    assert again == straight
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    for a, b in zip(masters, [p for g in resumed.param_groups for p in g["params"]]):
        assert torch.equal(a, b)  # the fp32 bits, not the fp16 model weights upcast


def test_a_model_loaded_after_prepare_is_not_overwritten_by_stale_masters() -> None:
    model = half_base()
    accelerator = Accelerator(mixed_precision="bf16", verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.head.parameters(), lr=0.0))
    loaded = torch.full_like(model.head.weight, 0.5)
    model.load_state_dict({**model.state_dict(), "head.weight": loaded})
    train(accelerator, model, optimizer, 1)
    assert torch.equal(model.head.weight, loaded)  # lr 0: the step keeps what was loaded


def test_step_in_backward_refuses_a_trainable_half_parameter_by_name() -> None:
    model = half_base(torch.bfloat16)
    accelerator = Accelerator(mixed_precision="bf16", step_in_backward=True, verbose=False)
    with pytest.raises(ValueError, match=r"parameter 'head.weight' is bfloat16 and trainable; .*float32"):
        accelerator.prepare(model, torch.optim.SGD(model.head.parameters(), lr=0.1))


def test_an_optimizer_that_already_stepped_is_refused_by_name() -> None:
    model = half_base()
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=0.1)
    model(**batch()).loss.backward()
    optimizer.step()
    accelerator = Accelerator(mixed_precision="fp16", verbose=False)
    model = accelerator.prepare(model)
    with pytest.raises(ValueError, match=r"'head.weight' is float16 .* prepare the optimizer before its first step"):
        accelerator.prepare(optimizer)


def test_fsdp_refuses_a_trainable_half_parameter_by_name() -> None:
    from mixprec.strategies.fsdp import check_no_low_precision_trainable

    with pytest.raises(ValueError, match=r"under FSDP2: parameter 'head.weight' is float16 .* float32"):
        check_no_low_precision_trainable(half_base())


@pytest.mark.parametrize("precision", ["fp16", "auto"])
def test_repeated_overflow_names_the_model_parameter_not_its_master(precision: str) -> None:
    from mixprec.scaling.record import ConsecutiveSkipsError

    model = half_base()
    accelerator = Accelerator(mixed_precision=precision, scaler_kwargs={"max_consecutive_skips": 2}, verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
    with pytest.raises(ConsecutiveSkipsError, match=r"head\.weight"):  # noqa: PT012
        for _ in range(3):
            accelerator.backward(model(**batch()).loss * float("inf"))
            optimizer.step()
            optimizer.zero_grad()


def test_accumulated_micro_batches_step_the_master_once_with_their_sum() -> None:
    """Two micro-batches of 4 rows under accumulate() step as one batch of 8 (SGD, fp16: the half gradients
    are summed on the model parameter, then copied to the master once, at the sync micro-batch)."""

    def stepped(accumulate: bool) -> torch.Tensor:
        model = half_base()
        accelerator = Accelerator(
            mixed_precision="fp16", gradient_accumulation_steps=2 if accumulate else 1, verbose=False
        )
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.head.parameters(), lr=1.0))
        full = batch()
        parts = [{k: v[:4] for k, v in full.items()}, {k: v[4:] for k, v in full.items()}] if accumulate else [full]
        for part in parts:
            with accelerator.accumulate(model):
                accelerator.backward(model(**part).loss)
                optimizer.step()
                optimizer.zero_grad()
        return optimizer.param_groups[0]["params"][0].detach().clone()

    before = half_base().head.weight.float()
    one, two = stepped(False), stepped(True)
    assert not torch.equal(one, before)
    torch.testing.assert_close(two - before, one - before, rtol=2e-2, atol=1e-5)  # fp16 sums of the halves


def test_a_fused_optimizer_steps_the_masters_with_the_true_gradient() -> None:
    """AdamW(fused=True) over masters: the scaler unscales the fp32 masters itself (the fused kernel would
    otherwise step with 65536x gradients), and an overflowing step is skipped."""

    def run(fused: bool) -> torch.Tensor:
        model = half_base()
        accelerator = Accelerator(mixed_precision="fp16", verbose=False)
        optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-2, fused=fused)
        model, optimizer = accelerator.prepare(model, optimizer)
        train(accelerator, model, optimizer, 3)
        before = model.head.weight.detach().clone()
        accelerator.backward(model(**batch()).loss * float("inf"))
        optimizer.step()
        assert optimizer.step_was_skipped and torch.equal(model.head.weight, before)
        return optimizer.param_groups[0]["params"][0].detach()

    torch.testing.assert_close(run(fused=True), run(fused=False), rtol=1e-5, atol=1e-6)
