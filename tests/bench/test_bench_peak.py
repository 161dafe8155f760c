"""bench.peak: the matmul probe MFU is measured against."""

from __future__ import annotations

import pytest
import torch

from mixprec.bench import peak


@pytest.fixture(autouse=True)
def _small_probe(monkeypatch):
    # the real cap (1024 on a CPU) costs about a second per dtype; 512 keeps the tests fast
    monkeypatch.setattr(peak, "_MAX_SIZE", {"cuda": 8192, "cpu": 512})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_is_measured_in_the_dtype_it_names(dtype):
    result = peak.measure_peak_flops(dtype, "cpu", repeats=2)
    name = str(dtype).removeprefix("torch.")
    assert result.dtype == name
    assert result.flops_per_s > 1e6  # any CPU does a 256^3 matmul faster than that
    assert 256 <= result.size <= 512
    assert name in result.source and "measured" in result.source and "cpu" in result.source


def test_peak_keeps_the_best_rate_seen(monkeypatch):
    # a fake clock: the 256 matmul looks fastest, 512 slower; the best (256) must be reported
    def fake(a, b, device):
        return {256: 2 * 256**3 / 4e9, 512: 2 * 512**3 / 1e9}[a.shape[0]]

    monkeypatch.setattr(peak, "_time_linear", fake)
    result = peak.measure_peak_flops(torch.float32, "cpu")
    assert result.size == 256
    assert result.flops_per_s == pytest.approx(4e9)


def test_every_dtype_is_timed_at_the_same_sizes(monkeypatch):
    # issue 29: fp32 stopped at 512 (fast enough to hit the time target) and bf16 went on to 1024, so the
    # fastest row showed the lowest MFU. Every dtype must see every size.
    sizes: dict[torch.dtype, list[int]] = {}

    def fake(a, b, device):
        sizes.setdefault(a.dtype, []).append(a.shape[0])
        return 1.0 if a.dtype == torch.float32 else 0.001  # fp32 "slow": the old rule stopped it at once

    monkeypatch.setattr(peak, "_time_linear", fake)
    for dtype in (torch.float32, torch.bfloat16):
        peak.measure_peak_flops(dtype, "cpu")
    assert sizes[torch.float32] == sizes[torch.bfloat16] and set(sizes[torch.float32]) == {256, 512}
