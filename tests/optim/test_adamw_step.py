"""optim/adamw_step.py: the one Adam(W) step AnyPrecisionAdamW shares with Bf16AdamW keeps AnyPrecisionAdamW's
numerics (HF's ``optim="adamw_anyprecision"``) for each of its options.

The reference is AdamW written out from its formula in plain torch ops, as AnyPrecisionAdamW's own loop computed
it before the step was shared: the moments read into fp32, updated, rounded to their storage dtype, the update from
the fp32 moments with bias corrections, decoupled decay from the weight before the step, and with Kahan summation
the compensation re-added and what the rounding lost kept in ``compensation_buffer_dtype``.
"""

from __future__ import annotations

import pytest
import torch

from mixprec.optim import AnyPrecisionAdamW, Bf16AdamW

LR, BETAS, EPS, WD, STEPS = 1e-2, (0.9, 0.999), 1e-8, 0.1, 6


def reference(w0: torch.Tensor, grads: list[torch.Tensor], m_dtype, v_dtype, kahan: bool, comp_dtype) -> dict:
    beta1, beta2 = BETAS
    p = w0.clone()
    m = torch.zeros_like(p, dtype=m_dtype)
    v = torch.zeros_like(p, dtype=v_dtype)
    comp = torch.zeros_like(p, dtype=comp_dtype) if kahan and p.dtype != torch.float32 else None
    for t, g in enumerate(grads, start=1):
        g = g.float()
        m32 = beta1 * m.float() + (1 - beta1) * g
        v32 = beta2 * v.float() + (1 - beta2) * g * g
        m, v = m32.to(m_dtype), v32.to(v_dtype)
        m_hat, v_hat = m32 / (1 - beta1**t), v32 / (1 - beta2**t)
        w = p.float()
        update = -LR * m_hat / (v_hat.sqrt() + EPS) - LR * WD * w
        if comp is None:
            p = (w + update).to(p.dtype)
            continue
        y = update + comp.float()  # this step plus what earlier roundings lost
        rounded = (w + y).to(p.dtype)
        comp = (y - (rounded.float() - w)).to(comp_dtype)  # what this rounding lost
        p = rounded
    return {"param": p, "exp_avg": m, "exp_avg_sq": v, "compensation": comp}


def shared_step(w0: torch.Tensor, grads: list[torch.Tensor], **options) -> dict:
    p = torch.nn.Parameter(w0.clone())
    opt = AnyPrecisionAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **options)
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()
    return {"param": p.detach(), **{k: t for k, t in opt.state[p].items() if k != "step"}}


def case(param_dtype: torch.dtype, n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(n, generator=g).to(param_dtype)
    grads = [(torch.randn(n, generator=g) * 1e-2).to(param_dtype) for _ in range(STEPS)]
    return w0, grads


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of ``a``'s dtype (both of one low-precision dtype)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(bits).int() - b.view(bits).int()).abs()


def test_fp32_weights_and_moments_match_the_formula_to_fp32_rounding():
    w0, grads = case(torch.float32)
    ours, ref = shared_step(w0, grads), reference(w0, grads, torch.float32, torch.float32, False, None)
    # fp32 op order differs (torch's fused kernel folds the bias corrections and decays first): measured up to
    # 3 ulps of the weight (1.4e-6 at |w| ~ 4); the bound is 8 ulps (rtol 1e-6)
    torch.testing.assert_close(ours["param"], ref["param"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours["exp_avg"], ref["exp_avg"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(ours["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("m_dtype, v_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_low_precision_moments_are_stored_rounded_and_the_update_matches(m_dtype, v_dtype):
    w0, grads = case(torch.float32)
    ours = shared_step(w0, grads, momentum_dtype=m_dtype, variance_dtype=v_dtype)
    ref = reference(w0, grads, m_dtype, v_dtype, False, None)
    assert ours["exp_avg"].dtype == m_dtype and ours["exp_avg_sq"].dtype == v_dtype
    # a moment whose fp32 value sits on a bf16 rounding boundary may tip by one ulp (1 in 2^8 of it), which moves
    # that element's later updates by under 1% of a step: weights within 1% of lr, moments within one ulp
    torch.testing.assert_close(ours["param"], ref["param"], rtol=0, atol=1e-2 * LR)
    assert int(ulps_apart(ours["exp_avg"], ref["exp_avg"]).max()) <= 1
    assert int((ours["exp_avg"] != ref["exp_avg"]).sum()) <= 0.01 * w0.numel()


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("comp_dtype", [torch.bfloat16, torch.float32])
def test_kahan_summation_keeps_the_same_value_and_compensation(param_dtype, comp_dtype):
    w0, grads = case(param_dtype)
    opts = dict(use_kahan_summation=True, compensation_buffer_dtype=comp_dtype)
    ours, ref = shared_step(w0, grads, **opts), reference(w0, grads, torch.float32, torch.float32, True, comp_dtype)
    assert ours["compensation"].dtype == comp_dtype
    # weight + compensation is what Kahan carries: the same to well under one step, even where an fp32
    # last-bit difference tipped the rounding of the weight (the compensation then holds the other side)
    carried = ours["param"].float() + ours["compensation"].float()
    expected = ref["param"].float() + ref["compensation"].float()
    torch.testing.assert_close(carried, expected, rtol=0, atol=1e-2 * LR)
    assert int((ours["param"] != ref["param"]).sum()) <= 0.01 * w0.numel()
    assert int(ulps_apart(ours["param"], ref["param"]).max()) <= 1


def test_low_precision_weights_without_kahan_round_to_nearest_as_before():
    w0, grads = case(torch.bfloat16)
    ours, ref = shared_step(w0, grads), reference(w0, grads, torch.float32, torch.float32, False, None)
    assert ours["param"].dtype == torch.bfloat16 and "compensation" not in ours
    assert int((ours["param"] != ref["param"]).sum()) <= 0.01 * w0.numel()
    assert int(ulps_apart(ours["param"], ref["param"]).max()) <= 1


def test_both_optimizers_take_the_same_step_for_the_same_rule():
    # the sharing itself: Bf16AdamW(rounding="kahan") and AnyPrecisionAdamW(use_kahan_summation=True) with
    # moments and compensation in the parameter's dtype are one step, bit for bit
    w0, grads = case(torch.bfloat16)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    bf16 = Bf16AdamW([a], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, rounding="kahan")
    anyp = AnyPrecisionAdamW(
        [b],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        use_kahan_summation=True,
        momentum_dtype=torch.bfloat16,
        variance_dtype=torch.bfloat16,
        compensation_buffer_dtype=torch.bfloat16,
    )
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        bf16.step()
        anyp.step()
    assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq", "compensation"):
        assert torch.equal(bf16.state[a][key], anyp.state[b][key]), key


def test_sparse_gradients_are_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="AnyPrecisionAdamW does not support sparse gradients"):
        AnyPrecisionAdamW([p]).step()


def test_a_loaded_state_keeps_the_groups_a_scheduler_on_the_replaced_optimizer_steers():
    """Pure bf16 swaps the user's AdamW for a Bf16AdamW sharing its group dicts, so the LR scheduler built on
    the AdamW steers it. torch's load_state_dict put new dicts in their place: after a resume the learning
    rate stayed at the checkpoint's (issue 34's combination matrix: bf16-pure resumed runs parted)."""
    from mixprec.precision.pure import PureBf16Precision

    model = PureBf16Precision("cpu").convert_module(torch.nn.Linear(4, 4))
    original = torch.optim.AdamW(model.parameters(), lr=1.0)
    optimizer = PureBf16Precision("cpu").convert_optimizer(original)
    scheduler = torch.optim.lr_scheduler.LambdaLR(original, lambda step: 0.5**step)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.5] and scheduler.get_last_lr() == [0.5]
    assert optimizer.param_groups is original.param_groups and optimizer.state_dict()["state"].keys() == {0, 1}
