"""bench.runner and bench.bench_config: every precision runs its own copy of the same work, in its own dtype."""

from __future__ import annotations

import pytest
import torch

from conftest import make_batches, make_tiny_lm
from mixprec.bench import BenchConfig, Workload, run_bench, sample_batches, workload_from_dataset

FAST = dict(steps=2, rounds=1, warmup=1, measure_peak=False)


def _workload(seed: int = 0) -> Workload:
    batches = make_batches(n=4, batch=4, seed=seed)
    return Workload(make_tiny_lm(seed), batches[:3], batches[3], description="tiny LM", flops_per_token=1000.0)


def test_every_precision_is_timed_the_same_number_of_steps():
    result = run_bench(_workload(), BenchConfig(precisions=("fp32", "fp16", "bf16"), **FAST, measure_memory=False))
    assert [r.precision for r in result.rows] == ["fp32", "fp16", "bf16"]
    for row in result.rows:
        assert row.times is not None and row.times.count == 2
        assert row.times.median > 0
        assert row.tokens_per_s == pytest.approx(4 * 8 / row.times.median)


def test_each_precision_really_computes_in_its_dtype():
    # a hook on the initial model is deep-copied into every precision's copy: it sees what each one ran
    seen: set[torch.dtype] = set()
    workload = _workload()
    workload.model.hidden.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    run_bench(workload, BenchConfig(precisions=("fp32", "fp16", "bf16"), **FAST, measure_memory=False))
    assert seen == {torch.float32, torch.float16, torch.bfloat16}


def test_the_initial_model_is_never_trained_and_all_start_from_it():
    workload = _workload()
    before = [p.detach().clone() for p in workload.model.parameters()]
    result = run_bench(workload, BenchConfig(precisions=("fp32", "bf16"), **FAST, measure_memory=False))
    for p, q in zip(workload.model.parameters(), before):
        assert torch.equal(p, q)
    # same init, same batches: after 3 small steps bf16's held-out loss is close to fp32's
    fp32, bf16 = result.rows
    assert abs(bf16.loss - fp32.loss) < 0.05
    assert result.to_dict()["results"][1]["loss_vs_fp32"] == pytest.approx(bf16.loss - fp32.loss)


def test_fp16_runs_with_loss_scaling_and_reports_it():
    result = run_bench(_workload(), BenchConfig(precisions=("fp16",), **FAST, measure_memory=False))
    (row,) = result.rows
    assert row.final_scale > 1.0  # the scaler was active: a disabled one reports 1.0
    assert row.skipped_steps >= 0


def test_auto_shares_the_run_of_the_mode_it_chose():
    result = run_bench(_workload(), BenchConfig(precisions=("fp32", "fp16", "bf16", "auto"), **FAST))
    auto = result.row("auto")
    twin = result.row(auto.resolved)
    assert auto.shares_measurement_with == auto.resolved
    assert auto.times == twin.times
    assert auto.reason.startswith("auto on cpu")
    verdict = result.auto_verdict()
    assert verdict["chose"] == auto.resolved
    assert verdict["ratio_to_fastest"] >= 1.0
    assert verdict["within_tolerance"] == (verdict["ratio_to_fastest"] <= 1.05)


def test_auto_alone_is_run_not_skipped():
    result = run_bench(_workload(), BenchConfig(precisions=("auto",), **FAST, measure_memory=False))
    (row,) = result.rows
    assert row.times is not None and row.shares_measurement_with is None


def test_mfu_uses_the_peak_of_the_compute_dtype(monkeypatch):
    from mixprec.bench import peak

    monkeypatch.setattr(peak, "_MAX_SIZE", {"cuda": 8192, "cpu": 256})
    result = run_bench(
        _workload(), BenchConfig(precisions=("fp32", "bf16"), steps=1, rounds=1, warmup=0, measure_memory=False)
    )
    fp32, bf16 = result.rows
    assert fp32.peak.dtype == "float32" and bf16.peak.dtype == "bfloat16"
    assert fp32.mfu == pytest.approx(1000.0 * fp32.tokens_per_s / fp32.peak.flops_per_s)


def test_a_policy_that_keeps_linear_in_fp32_is_measured_against_fp32s_peak(monkeypatch):
    # its matmuls run in fp32: against fp16's (emulated, slow) peak its MFU read 91-108%
    from mixprec.bench import peak

    monkeypatch.setattr(peak, "_MAX_SIZE", {"cuda": 8192, "cpu": 256})
    config = BenchConfig(precisions=("fp16:fp32_ops=linear", "fp16:fp32_ops=attention"), steps=1, rounds=1, warmup=0)
    linear, attention = run_bench(_workload(), config).rows
    assert linear.peak.dtype == "float32" and attention.peak.dtype == "float16"


def test_a_bench_of_modes_this_machine_cannot_run_says_so_in_the_table():
    # every arm left out: the rounds divided by zero arms
    result = run_bench(_workload(), BenchConfig(precisions=("fp8",), **FAST, measure_memory=False))
    assert [(r.precision, r.times) for r in result.rows] == [("fp8", None)] and result.rows[0].skipped


@pytest.mark.skipif(not __import__("mixprec.bench").bench.cpu_memory_supported(), reason="Linux only")
def test_peak_memory_is_measured_per_precision():
    result = run_bench(_workload(), BenchConfig(precisions=("fp32", "bf16"), **FAST))
    for row in result.rows:
        assert row.peak_mem_bytes is not None and row.peak_mem_bytes >= 0
        assert "VmHWM" in row.peak_mem_source


def test_speedups_are_relative_to_the_fp32_row():
    result = run_bench(_workload(), BenchConfig(precisions=("fp32", "bf16"), **FAST, measure_memory=False))
    fp32, bf16 = result.to_dict()["results"]
    assert fp32["speedup_vs_fp32"] == 1.0
    assert bf16["speedup_vs_fp32"] == pytest.approx(fp32["step_time_s"] / bf16["step_time_s"])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(precisions=("fp17",)), "precisions"),
        (dict(precisions=()), "precisions"),
        (dict(precisions=("fp16", "16-mixed")), "precisions"),
        (dict(steps=0), "steps"),
        (dict(rounds=0), "rounds"),
        (dict(warmup=-1), "warmup"),
        (dict(lr=0.0), "lr"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BenchConfig.{field}"):
        BenchConfig(**kwargs)


def test_config_accepts_a_comma_separated_string():
    assert BenchConfig(precisions="fp32, bf16").precisions == ("fp32", "bf16")


def test_sample_batches_is_deterministic_and_covers_the_data():
    data = [{"input_ids": torch.tensor([i, i])} for i in range(10)]
    a = sample_batches(data, 2, 5, seed=3)
    b = sample_batches(data, 2, 5, seed=3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    seen = sorted(int(v) for batch in a for v in batch["input_ids"][:, 0])
    assert seen == list(range(10))  # without replacement: one pass sees every item once


def test_workload_from_dataset_holds_out_an_eval_batch():
    train = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(8)]
    val = [{"input_ids": torch.full((4,), 100 + i), "labels": torch.full((4,), 100 + i)} for i in range(2)]
    w = workload_from_dataset(make_tiny_lm(), train, val, batch_size=2, num_batches=3)
    assert len(w.batches) == 3 and w.tokens_per_step == 8
    assert int(w.eval_batch["input_ids"].min()) >= 100
    assert w.flops_per_token == 6.0 * sum(p.numel() for p in w.model.parameters())


def test_auto_is_raced_on_the_workloads_own_step_and_the_race_is_in_the_json():
    result = run_bench(_workload(), BenchConfig(precisions=("fp32", "bf16", "auto"), **FAST, measure_memory=False))
    race = result.to_dict()["auto_race"]
    assert race["source"] == "measured" and race["candidates"] == ["fp32", "bf16", "fp16"]
    assert race["chosen"] == result.row("auto").resolved
    assert "raced the candidates on the training step" in result.row("auto").reason


def test_pure_bf16_is_benchmarked_with_its_own_optimizer_at_8_bytes_per_parameter():
    result = run_bench(_workload(), BenchConfig(precisions=("fp32", "bf16-pure"), **FAST, measure_memory=False))
    fp32, pure = result.rows
    assert fp32.bytes_per_param == pytest.approx(16.0) and pure.bytes_per_param == pytest.approx(8.0)
    assert result.to_dict()["results"][1]["bytes_per_param"] == pytest.approx(8.0)
