"""bench.memory: peak memory of a piece of work, above the level before it."""

from __future__ import annotations

import pytest
import torch

from mixprec.bench.memory import cpu_memory_supported, measure_run

MIB = 2**20

needs_rss = pytest.mark.skipif(not cpu_memory_supported(), reason="no resettable peak RSS (Linux only)")


def _allocating(nbytes: int):
    def prepare():
        def run():
            t = torch.ones(nbytes // 4, dtype=torch.float32)  # ones: pages are touched, so resident
            del t

        return run

    return prepare


@needs_rss
def test_cpu_peak_counts_a_tensor_the_work_allocated_and_freed():
    m = measure_run(_allocating(64 * MIB), "cpu")
    assert m is not None
    assert 60 * MIB <= m.peak_bytes <= 100 * MIB
    assert "VmHWM" in m.source


@needs_rss
def test_cpu_peak_excludes_what_prepare_loaded_and_earlier_peaks():
    big = []

    def prepare():
        big.append(torch.ones(96 * MIB // 4))  # loaded before the measured work: not counted
        return lambda: None

    measure_run(_allocating(128 * MIB), "cpu")  # an earlier, larger peak must not leak into the next one
    m = measure_run(prepare, "cpu")
    assert m is not None
    assert m.peak_bytes < 16 * MIB


def test_a_device_without_counters_is_refused_not_guessed():
    assert measure_run(lambda: lambda: None, "meta") is None
