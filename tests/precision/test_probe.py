"""The CPU speed probe behind precision="auto": what it measures, that it reports its cost, and that a
process pays for it once.

No wall-clock asserts: the box is shared, so timings are facts the probe reports, not thresholds we test."""

from __future__ import annotations

import pytest
import torch

from mixprec.precision import probe as probe_module
from mixprec.precision.probe import ProbeResult


def test_probe_times_a_training_step_in_every_mode_and_reports_its_cost():
    result = probe_module.cpu_probe()
    assert set(result.step_seconds) == {"fp32", "bf16", "fp16"}
    assert all(t > 0 for t in result.step_seconds.values())
    # it timed at least a warm-up and one round of each mode, so it cost more than one step of each
    assert result.cost_seconds > sum(result.step_seconds.values())
    assert result.chosen == probe_module.choose(result.step_seconds, result.best_seconds)
    assert all(result.best_seconds[n] <= result.step_seconds[n] for n in result.step_seconds)
    assert result.threads == 1
    assert result.speedups()["fp32"] == 1.0


def test_probe_is_measured_once_per_process(monkeypatch):
    monkeypatch.setattr(probe_module, "_cache", {})
    calls = []
    fake = ProbeResult({"fp32": 1.0, "bf16": 2.0, "fp16": 3.0}, "fp32", cost_seconds=0.25)
    monkeypatch.setattr(probe_module, "measure_cpu", lambda: calls.append(1) or fake)
    first = probe_module.cpu_probe()
    second = probe_module.cpu_probe()
    assert first is second is fake
    assert calls == [1]
    assert "probe took 0.25s" in second.explain()  # the cost reported is the one measured, not re-measured


def test_probe_runs_on_one_thread_and_restores_the_callers_setting():
    # per-core kernel speed is what a dtype changes; one thread keeps neighbours' load out of the ratio
    seen = []
    real_step = probe_module._step
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(probe_module, "_step", lambda *a: seen.append(torch.get_num_threads()) or real_step(*a))
            result = probe_module.measure_cpu()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {1}
    assert result.threads == 1


def test_probe_step_runs_forward_and_backward_under_autocast():
    model = probe_module._probe_model()
    x = torch.randn(2, 8, probe_module._WIDTH)
    targets = torch.randint(0, probe_module._VOCAB, (2, 8))
    seen = []
    hook = model.qkv.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    for dtype in (None, torch.bfloat16, torch.float16):
        model.zero_grad()
        probe_module._step(model, x, targets, dtype)
        assert all(p.grad is not None for p in model.parameters())  # backward ran through every layer
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16, torch.float16]  # the casts autocast adds are in the probe


def test_building_the_probe_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    probe_module._probe_model()
    assert torch.equal(torch.rand(3), expected)


def test_explain_names_every_measured_mode():
    result = ProbeResult({"fp32": 0.01, "bf16": 0.04, "fp16": 0.05}, "fp32", cost_seconds=0.3)
    text = result.explain()
    assert "fp32 1.00x, bf16 0.25x, fp16 0.20x" in text
    assert "probe took 0.30s" in text and text.endswith("chose fp32")
