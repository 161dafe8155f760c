"""Log2 histograms count exactly what each format would do to a value, at any power-of-two loss scale."""

from __future__ import annotations

import math

import torch

from mixprec.diagnostics.histogram import E_MIN, DeviceHistogram, to_host
from mixprec.diagnostics.recommend import MAX_SCALE_EXP, choose_scale_exp
from mixprec.precision.formats import BF16, FP16


def _hist(values: list[float]) -> DeviceHistogram:
    h = DeviceHistogram(torch.device("cpu"))
    h.add(torch.tensor(values, dtype=torch.float32))
    return h


def test_bins_are_exact_binary_exponents() -> None:
    values = [1.0, 1.999, -2.0, 2.0**-24, 2.0**-24 * 0.999, 2.0**-149, 65504.0]
    (h,) = to_host([_hist(values)])
    expected = {0: 2, 1: 1, -24: 1, -25: 1, -149: 1, 15: 1}
    for e, n in expected.items():
        assert h.counts[e - E_MIN] == n, e
    assert h.nonzero == len(values)


def test_zeros_and_nonfinite_are_counted_apart_not_as_underflow() -> None:
    (h,) = to_host([_hist([0.0, -0.0, float("inf"), float("nan"), 1e-9, 1.0])])
    assert (h.zeros, h.nonfinite, h.nonzero, h.total) == (2, 2, 2, 6)
    assert h.underflow_fraction(FP16) == 0.5  # 1e-9 of the two nonzero finite values; zeros are not underflow
    assert h.max_abs == 1.0  # inf is not a magnitude
    assert h.overflow == {"fp16": 1, "bf16": 1}  # inf overflows every format; NaN is not "above max"


def test_underflow_and_subnormal_follow_fp16_and_bf16_thresholds() -> None:
    below = 2.0**-25  # under fp16's smallest subnormal 2^-24
    sub = 2.0**-20  # fp16 subnormal (< 2^-14)
    normal = 2.0**-10
    (h,) = to_host([_hist([below, sub, sub, normal])])
    assert h.underflow_fraction(FP16) == 0.25
    assert h.subnormal_fraction(FP16) == 0.5
    # at loss scale 2^4: 2^-25 -> 2^-21 (subnormal), 2^-20 -> 2^-16 (subnormal), 2^-10 -> 2^-6 (normal)
    assert h.underflow_fraction(FP16, 4) == 0.0
    assert h.subnormal_fraction(FP16, 4) == 0.75
    assert h.underflow_fraction(BF16) == 0.0 and h.subnormal_fraction(BF16) == 0.0
    (tiny,) = to_host([_hist([2.0**-140, 2.0**-130])])  # fp32 subnormals; bf16: below 2^-133 / subnormal
    assert tiny.underflow_fraction(BF16) == 0.5 and tiny.subnormal_fraction(BF16) == 0.5


def test_activation_overflow_uses_the_exact_maxima() -> None:
    (h,) = to_host([_hist([65504.0, 65505.0, -7e4, 3.0e38, 1.0])])
    assert h.overflow["fp16"] == 3  # 65504 itself is representable
    assert h.overflow_fraction(FP16) == 3 / 5
    assert h.overflow["bf16"] == 0  # 3.0e38 < bf16 max ~3.39e38
    (big,) = to_host([_hist([3.395e38])])
    assert big.overflow["bf16"] == 1


def test_low_precision_and_fp64_inputs_and_merge() -> None:
    h = DeviceHistogram(torch.device("cpu"))
    h.add(torch.tensor([2.0**-20], dtype=torch.float16))
    h.add(torch.tensor([1e-300, 1e300], dtype=torch.float64))  # beyond fp32: kept at fp32's extremes
    h.add(torch.empty(0))
    (a,) = to_host([h])
    assert a.nonzero == 3 and a.total == 3
    assert a.underflow_fraction(FP16) == 1 / 3 and a.subnormal_fraction(FP16) == 1 / 3
    assert a.count_below(-148) == 1 and a.counts[127 - E_MIN] == 1 and a.overflow["fp16"] == 1
    merged = a.merge(a)
    assert merged.nonzero == 6 and merged.counts[-20 - E_MIN] == 2


def test_scale_is_the_largest_power_of_two_with_headroom() -> None:
    for max_grad in (1e-3, 0.37, 1.0, 2.0**-7):
        k = choose_scale_exp(max_grad, headroom=8.0)
        assert max_grad * 2.0**k * 8 <= FP16.max < max_grad * 2.0 ** (k + 1) * 8, max_grad
    # at the boundary: 2^-7 * 2^k * 8 = 2^(k-4) <= 65504 holds up to k = 19 (2^16 = 65536 would not)
    assert choose_scale_exp(2.0**-7, 8.0) == 19
    assert choose_scale_exp(1e-12, 8.0) == MAX_SCALE_EXP  # capped
    assert choose_scale_exp(1e6, 8.0) == 0  # never below 1
    assert choose_scale_exp(0.0, 8.0) == 16  # nothing seen: torch's default
    assert choose_scale_exp(math.inf, 8.0) == 16
