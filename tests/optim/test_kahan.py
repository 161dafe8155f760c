"""The Kahan update shared by Bf16AdamW(rounding="kahan") and AnyPrecisionAdamW(use_kahan_summation=True)."""

from __future__ import annotations

import torch

from mixprec.optim.kahan import kahan_update_


def _apply(n: int, step: float, kahan: bool) -> torch.Tensor:
    w = torch.ones(4, dtype=torch.bfloat16)
    comp = torch.zeros_like(w)
    for _ in range(n):
        update = torch.full((4,), step)
        if kahan:
            kahan_update_(w, w.float(), update, comp)
        else:
            w.copy_((w.float() + update).to(torch.bfloat16))
    return w


def test_small_updates_to_a_large_weight_are_lost_without_compensation_and_kept_with_it() -> None:
    # 1e-3 is below half of bf16's spacing at 1.0 (2**-7 / 2 = 3.9e-3): plain rounding drops every update
    assert torch.equal(_apply(200, 1e-3, kahan=False), torch.ones(4, dtype=torch.bfloat16))
    kept = _apply(200, 1e-3, kahan=True).float()
    assert torch.allclose(kept, torch.full((4,), 1.2), atol=2**-7)  # within one bf16 step of the exact sum


def test_the_buffer_holds_what_the_rounding_lost_and_work_gives_the_same_result() -> None:
    w = torch.tensor([1.0, -3.0, 100.0], dtype=torch.bfloat16)
    update = torch.tensor([1e-3, -2e-3, 0.3])
    a, ca = w.clone(), torch.zeros_like(w)
    b, cb = w.clone(), torch.zeros_like(w)
    kahan_update_(a, a.float(), update.clone(), ca)
    kahan_update_(b, b.float(), update.clone(), cb, work=torch.empty(3))
    assert torch.equal(a, b) and torch.equal(ca, cb)
    exact = w.float() + update
    # nothing lost but the bf16 buffer's own rounding of the loss (2**-9 relative to 0.2 here)
    assert torch.allclose(a.float() + ca.float(), exact, rtol=0, atol=1e-3)
    assert not torch.allclose(a.float(), exact, rtol=0, atol=1e-3)  # the weight alone did lose it
