"""`mixprec diagnose`: the report a user reads (table), the one a script reads (--json), the PNG, and
one-line errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mixprec.cli.main import main

FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--batches", "2"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("def add(a, b):\n    return a + b\n" * 200)
    return path


def test_json_is_the_report_alone_on_stdout(corpus, tmp_path):
    png = tmp_path / "hist.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixprec.cli.main",
            "diagnose",
            "--data",
            str(corpus),
            *FAST,
            "--json",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # nothing else on stdout
    assert report["recommended_precision"] in ("fp16", "bf16", "fp32")
    assert report["recommended_init_scale"] >= 1
    assert report["first_nonfinite"] is None
    names = [layer["name"] for layer in report["layers"]]
    assert any(name.endswith("c_attn") for name in names)
    for layer in report["layers"]:
        for key in ("grad_underflow_fp16", "grad_subnormal_fp16", "act_overflow_fp16", "grad_underflow_bf16"):
            assert key in layer
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_names_the_recommendation_and_the_layers(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # issue 29: no PNG in the folder the user stands in unless asked for
    assert main(["diagnose", "--data", str(corpus), *FAST, "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "recommended precision:" in out and "initial loss scale" in out
    # issue 29: safety and speed named apart; the recommendation is the fastest safe mode, by auto's race
    (rec,) = [line for line in out.splitlines() if line.startswith("recommended precision:")]
    (safety,) = [line for line in out.splitlines() if line.startswith("  safety: ")]
    (speed,) = [line for line in out.splitlines() if line.startswith("  speed: auto's race on this batch")]
    chosen = speed.rsplit("fastest safe: ", 1)[1]
    assert rec.startswith(f"recommended precision: {chosen} (the fastest of the safe modes)")
    assert chosen == "fp32" or chosen in safety
    assert "first non-finite under fp16: none found" in out
    assert [p for p in tmp_path.iterdir() if p != corpus] == []


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["diagnose", "--data", str(tmp_path / "missing.txt"), *FAST, "--no-plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixprec diagnose: error:") and "missing.txt" in err and "\n" not in err
    assert main(["diagnose", "--precision", "fp17", *FAST, "--no-plot"]) == 2
    assert "fp17" in capsys.readouterr().err


@pytest.mark.parametrize("plot", ["missing/x.png", "."])
def test_an_unwritable_plot_path_is_refused_before_the_diagnosis(corpus, tmp_path, capsys, monkeypatch, plot):
    # issue 34: --plot /nonexistent/x.png failed only after the whole diagnosis had run
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", "--data", str(corpus), *FAST, "--plot", plot]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"mixprec diagnose: error: --plot {plot}: ")
    assert "diagnosing" not in captured.out + captured.err  # nothing ran


@pytest.mark.distributed
def test_under_torchrun_the_main_process_alone_reports_and_plots(corpus, tmp_path):
    # probe: each of the 2 processes printed its own report (two JSON documents on stdout) and wrote the plot
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    png = tmp_path / "hist.png"
    argv = ["-m", "mixprec.cli.main", "diagnose", "--data", str(corpus), *FAST, "--json", "--plot", str(png)]
    proc = subprocess.run(
        [*launch, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr  # the processes leave the group together
    report = json.loads(proc.stdout)  # one document: the main process's
    assert report["recommended_precision"] in ("fp16", "bf16", "fp32")
    assert proc.stderr.count("diagnosing built-in GPT") == 1
    assert proc.stderr.count("histograms written to") == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
