"""The matrix's comm-dtype cells (issue 34; see test_combinations.py): each precision with one communication dtype
under 2 processes (torchrun, gloo), through the Accelerator. One launch runs all 8 (combo_comm_worker.py); each
cell reads its rank files: both ranks hold the same weights, both skip the step whose gradient was non-finite on
rank 1 only, no line names a format the run neither computes nor communicates in, and nothing is written
outside the run folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from combo_checks import Findings, Said, SkipLeaked, WroteOutside

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("combo_comm_worker.py")
# each precision with one comm dtype: every dtype under a mode that computes in another one at least once
COMM = {
    "fp32": "bf16",
    "fp16": "fp16",
    "bf16": "fp16",
    "bf16-pure": "bf16",
    "bf16-pure-kahan": "fp32",
    "bf16:fp32_ops=attention": "bf16",
    "auto-inrun": "bf16",
    "auto-aside": "fp16",
}
KNOWN: dict[str, tuple[type[BaseException], str]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """One torchrun launch of every cell, in a sandbox: cwd, HOME, cache and temp folders of its own."""
    root = tmp_path_factory.mktemp("comm")
    cwd, home, tmp, out = (root / d for d in ("cwd", "home", "tmp", "out"))
    for d in (cwd, home, tmp, out):
        d.mkdir()
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MIXPREC_AUTO_RACE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        OMP_NUM_THREADS="1",
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        TMPDIR=str(tmp),
        COMBO_COMM=json.dumps(COMM),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(WORKER),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    outside = [
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file()
        and not p.is_relative_to(out)
        and not any(p.is_relative_to(cwd / f"run-{i}") for i in range(len(COMM)))
    ]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    return {"ranks": ranks, "outside": outside, "printed": proc.stdout + proc.stderr}


def _cells() -> list:
    marks = {p: [pytest.mark.xfail(strict=True, raises=k[0], reason=k[1])] for p, k in KNOWN.items()}
    return [pytest.param(p, c, id=f"{p}-comm-{c}", marks=marks.get(p, [])) for p, c in COMM.items()]


@pytest.mark.parametrize(("precision", "comm"), _cells())
def test_comm_cell(launched, precision, comm):
    findings = Findings()
    first, second = (r[precision] for r in launched["ranks"])
    assert "refused" not in first, first.get("refused")
    assert first["weights"] == second["weights"], "the two processes hold different weights"
    expected = [step == 2 for step in range(1, 5)]
    for rank, result in enumerate((first, second)):
        findings.expect(
            result["skipped"] == expected,
            SkipLeaked,
            f"rank {rank} skipped {result['skipped']}: rank 1's planted step 2 must skip on both",
        )
    said = Said(lines=first["lines"] + second["lines"])
    said.formats_named(precision, findings, also=frozenset({comm}))  # the gradients travel in it
    findings.expect(not launched["outside"], WroteOutside, f"written outside the run folders: {launched['outside']}")
    findings.check()
