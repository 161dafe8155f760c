"""The recommendation falls through fp16 -> bf16 -> fp32 for stated reasons, never to an unsupported mode."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.diagnostics import diagnose
from mixprec.precision import Bf16MixedPrecision, PrecisionNotSupportedError


class TinyGrads(nn.Module):
    def __init__(self, loss_mult: float = 1e-9) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.loss_mult = loss_mult

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x), y) * self.loss_mult


class HugeActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(self.a(x) * 1e6), y)  # 1e6 * O(1): inf in fp16


def _batches(n: int, d_in: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, d_in, generator=g), "y": torch.randn(8, 1, generator=g)} for _ in range(n)]


def test_gradients_below_both_ranges_recommend_fp32() -> None:
    torch.manual_seed(0)
    # loss * 1e-40: gradients are fp32 subnormals (~1e-41), below fp16 at any scale and below bf16's 2^-133
    report = diagnose(TinyGrads(loss_mult=1e-40), _batches(2, 16))
    assert report.summary["grad_underflow_bf16"] > 0.01
    assert report.recommended_precision == "fp32"
    assert any(r.startswith("not fp16:") for r in report.reasons)
    assert any(r.startswith("not bf16:") and "flush to zero in bf16" in r for r in report.reasons)


def test_bf16_unsupported_device_is_not_recommended(monkeypatch) -> None:
    def no_bf16(cls, device):
        raise PrecisionNotSupportedError("bf16 is not supported on this test device; use fp16")

    # the strategy itself refuses the device, as on a GPU without bf16 (issue 35: no name table to patch)
    monkeypatch.setattr(Bf16MixedPrecision, "check_supported", classmethod(no_bf16))
    torch.manual_seed(0)
    report = diagnose(HugeActivation(), _batches(2, 8))  # fp16 overflows, and bf16 is "unavailable"
    assert report.recommended_precision == "fp32"
    assert report.bf16_supported is False
    assert "not bf16: bf16 is not supported on this test device; use fp16" in report.reasons
    assert "bf16" not in report.nonfinite_checks  # never ran under a mode the device refuses


def test_bf16_target_is_kept_when_it_works() -> None:
    torch.manual_seed(0)
    report = diagnose(TinyGrads(), _batches(2, 16), precision_target="bf16-mixed")  # aliases via the registry
    assert report.precision_target == "bf16"
    assert report.recommended_precision == "bf16"
    assert list(report.nonfinite_checks) == ["bf16"]
    assert report.recommended_init_scale == 2.0**24  # still reported, for fp16 users


def test_the_lost_update_fraction_says_whether_pure_bf16_needs_compensation() -> None:
    # A tiny learning rate against O(1) weights: updates far below half a bf16 ulp round away.
    torch.manual_seed(0)
    small = diagnose(TinyGrads(loss_mult=1.0), _batches(2, 16), lr=1e-7)
    assert small.summary["bf16_update_lost"] > 0.5
    assert any(r.startswith("pure bf16 needs compensation here") and "'bf16-pure'" in r for r in small.reasons)
    torch.manual_seed(0)
    large = diagnose(TinyGrads(loss_mult=1.0), _batches(2, 16), lr=1.0)
    assert large.summary["bf16_update_lost"] < 0.001
    assert any("'bf16-pure' needs no compensation for this model" in r for r in large.reasons)
