"""benchmarks/bench_after_save.py: its rounds run as processes and report a step before and after a save."""

from __future__ import annotations

import json

from benchmarks import bench_after_save


def test_the_benchmark_reports_the_step_before_and_after_an_async_save(tmp_path, capsys):
    out = tmp_path / "after.json"
    argv = ["--precision", "fp32", "--rounds", "1", "--steps", "2", "--threads", "1", "--json", str(out)]
    assert bench_after_save.main(argv) == 0
    record = json.loads(out.read_text())
    (only,) = record["rounds"]
    assert only["before_ms"] > 0 and only["after_ms"] > 0
    assert record["ratio"] == only["after_ms"] / only["before_ms"]
    assert "median ratio after / before" in capsys.readouterr().out
