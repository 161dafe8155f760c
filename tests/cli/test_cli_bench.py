"""``mixprec bench``: the table, --json alone on stdout, the chart, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mixprec.cli.main import main

FAST = [
    "bench",
    "--model",
    "tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--rounds",
    "1",
    "--steps",
    "1",
    "--warmup",
    "0",
]


def test_table_on_stdout_has_every_precision(capsys):
    threads = torch.get_num_threads()
    assert main([*FAST, "--no-memory"]) == 0
    assert torch.get_num_threads() == threads  # bench's 1-thread default does not leak into the caller
    out = capsys.readouterr().out
    assert "cpu (" in out and " 1 thread," in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()]
    for name in ("fp32", "fp16", "bf16", "auto"):
        assert name in rows, name
    assert "built-in GPT 'tiny'" in out


def test_json_alone_on_stdout_table_on_stderr_and_a_chart(tmp_path):
    # a real process: catches prints from any layer (warnings, progress), C-level writes included
    png = tmp_path / "bench.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [*FAST, "--precisions", "fp32,bf16", "--json", "--output", str(png)]
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec.cli.main", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert [r["precision"] for r in doc["results"]] == ["fp32", "bf16"]
    assert doc["results"][1]["compute_dtype"] == "bfloat16"
    assert doc["config"]["rounds"] == 1 and doc["config"]["steps"] == 1
    assert doc["results"][0]["peak_mem_bytes"] is None or doc["results"][0]["peak_mem_bytes"] > 0
    assert "[bench]" in proc.stderr and "precision" in proc.stderr  # progress and the table
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precisions", "fp32,fp17"], "unknown precision 'fp17'"),
        (["--precision", "bf16"], "use --precisions"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--policy", "bf16:fp32_ops=attn"], "--policy: precision 'bf16:fp32_ops=attn': unknown op kind 'attn'"),
        (["--policy", "measured:fp32"], "measured policies refine bf16 or fp16"),
        (["--fp32-ops", "attention"], "--fp32-ops: bench adds a per-op-kind policy as a row of its own"),  # ignored
        (["--output", "chart.txt"], "--output chart.txt: a plot is written as .png"),  # matplotlib's, at the end
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main([*FAST, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_policy_row_beside_the_uniform_modes(capsys):
    # the policy's own commas survive (it has its own flag); it runs as itself, not as bf16
    assert main([*FAST, "--precisions", "fp32,bf16", "--policy", "bf16:fp32_ops=attention,norm", "--no-memory"]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines() if line.split()]
    assert ["bf16:fp32_ops=attention,norm", "bf16:fp32_ops=attention,norm"] in rows


def test_a_measured_policy_row_comes_with_its_timings(capsys):
    assert main([*FAST, "--precisions", "fp32", "--policy", "measured", "--no-memory"]) == 0
    captured = capsys.readouterr()
    assert "per-op-kind timing on cpu" in captured.err and "attention" in captured.err  # each kind's two timings
    chosen = next(line for line in captured.out.splitlines() if "--policy measured ->" in line)
    policy = chosen.split("-> ")[1].split()[0]
    assert [policy, policy] in [line.split()[:2] for line in captured.out.splitlines() if line.split()]


def test_one_process_for_the_communication_comparison_is_refused(capsys):
    # issue 34: --nproc-per-node 1 ran a plain one-process bench though the help says N >= 2
    with pytest.raises(SystemExit) as stop:
        main([*FAST, "--nproc-per-node", "1"])
    assert stop.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert "--nproc-per-node: 1 process has no gradients to communicate: give N >= 2" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # probe: --output was accepted with --nproc-per-node, then no chart was written and nothing said
        (["--nproc-per-node", "2", "--output", "c.png"], "--output c.png: the chart is the one-process bench's"),
        (["--nproc-per-node", "2", "--policy", "measured"], "a measured policy is timed in one process"),
        (["--nproc-per-node", "2", "--policy", "bf16", "--precisions", "fp32"], "give --policy or --precisions"),
        (["--comm-dtypes", "bf16"], "--comm-dtypes compares processes' gradient traffic: add --nproc-per-node 2"),
    ],
)
def test_a_flag_the_other_mode_would_ignore_is_refused_before_any_work(capsys, argv, message):
    assert main([*FAST, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.distributed
def test_two_processes_json_is_one_document_of_the_comm_rows(tmp_path):
    # probe: --json under --nproc-per-node was not forwarded to the processes; stdout was the text table
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    argv = [*FAST, "--nproc-per-node", "2", "--comm-dtypes", "fp32,bf16", "--json"]
    argv += ["--policy", "bf16:fp32_ops=attention,norm"]  # a policy's commas travel to the processes intact
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec.cli.main", *argv],
        capture_output=True,
        text=True,
        env=dict(env, OMP_NUM_THREADS="1"),
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document, from the main process only
    assert doc["processes"] == 2 and doc["config"]["precision"] == "bf16:fp32_ops=attention,norm"
    fp32, bf16 = doc["results"]
    assert (fp32["comm"], bf16["comm"]) == ("fp32", "bf16")
    assert bf16["bytes_per_step"] * 2 == fp32["bytes_per_step"] > 0 and bf16["bytes_vs_first"] == 0.5
    assert fp32["timed_steps"] == 1 and bf16["step_time_s"] > 0
    assert proc.stderr.count("gradients on the wire, 2 processes") == 1  # the table, on stderr
