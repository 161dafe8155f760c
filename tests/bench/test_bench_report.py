"""bench.render: the table, the JSON document and the chart."""

from __future__ import annotations

import json

import pytest

from conftest import make_batches, make_tiny_lm
from mixprec.bench import BenchConfig, Workload, format_table, run_bench, to_json, write_chart

REQUIRED = {
    "precision",
    "step_time_s",
    "step_time_spread_s",
    "tokens_per_s",
    "speedup_vs_fp32",
    "peak_mem_bytes",
    "loss",
    "loss_vs_fp32",
    "mfu",
    "peak_flops_source",
}


@pytest.fixture(scope="module")
def result():
    batches = make_batches(n=3, batch=4)
    workload = Workload(make_tiny_lm(), batches[:2], batches[2], description="tiny LM", flops_per_token=1e3)
    # memory is covered in test_bench_runner; here only how the report shows it
    cfg = BenchConfig(
        precisions=("fp32", "fp16", "bf16", "auto"),
        steps=1,
        rounds=1,
        warmup=0,
        measure_peak=False,
        measure_memory=False,
    )
    return run_bench(workload, cfg)


def test_table_has_a_row_per_precision_and_names_its_measures(result):
    table = format_table(result)
    lines = table.splitlines()
    for name in ("fp32", "fp16", "bf16", "auto"):
        assert any(line.startswith(name) for line in lines), name
    assert "interquartile" in table
    assert "peak mem: not measured" in table
    assert "auto chose" in table


def test_json_has_the_documented_schema(result):
    doc = json.loads(to_json(result))
    assert doc["device"] == "cpu"
    assert [r["precision"] for r in doc["results"]] == ["fp32", "fp16", "bf16", "auto"]
    for row in doc["results"]:
        assert REQUIRED <= set(row), REQUIRED - set(row)
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
    assert doc["auto"]["chose"] in ("fp32", "fp16", "bf16")


def test_json_writes_nan_as_null(result, monkeypatch):
    row = result.rows[0]
    monkeypatch.setattr(row, "loss", float("nan"))
    doc = json.loads(to_json(result))  # strict parsers reject NaN literals
    assert doc["results"][0]["loss"] is None


def test_chart_is_a_png(result, tmp_path):
    path = write_chart(result, tmp_path / "sub" / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_difference_that_rounds_to_zero_prints_without_a_minus():
    from mixprec.bench.render import _num

    assert _num(-1e-7, "+.4f") == "+0.0000" and _num(-0.25, "+.4f") == "-0.2500" and _num(-1e-9, ".4f") == "0.0000"
    assert _num(None, ".4f") == "-"
