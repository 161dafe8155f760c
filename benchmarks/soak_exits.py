"""Soak of clean exits (issue 24): many 2-process ``mixprec torchrun ... train`` runs, each must exit 0.

A finished gloo worker used to abort at interpreter exit now and then (SIGABRT in process-group teardown:
see mixprec.strategies.process_group), which torchrun reports as a failed job and may restart. Each run
here trains the tiny GPT for a few steps (with a checkpoint, an evaluation and the final report) into a
fresh folder; the launcher's exit status is recorded, and the log of any run that did not exit 0 is kept.

    python -m benchmarks.soak_exits --runs 50
    python -m benchmarks.soak_exits --runs 50 -- --comm-dtype bf16     # extra `mixprec train` flags

Exit status 0 when every run exited 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--keep", default=None, help="folder for the logs of failed runs (default: a temporary one)")
    parser.add_argument("extra", nargs="*", help="extra flags for mixprec train (after --)")
    args = parser.parse_args()
    keep = Path(args.keep or tempfile.mkdtemp(prefix="mixprec-exits-"))
    keep.mkdir(parents=True, exist_ok=True)
    statuses = []
    began = time.perf_counter()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "mixprec.cli.torchrun",
                "--nproc-per-node",
                "2",
                "-m",
                "mixprec.cli.main",
                "train",
                "--model",
                "tiny",
                "--max-steps",
                "5",
                "--seq-len",
                "32",
                "--batch-size",
                "4",
                "--output-dir",
                str(Path(tmp) / "run"),
                *args.extra,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        statuses.append(proc.returncode)
        if proc.returncode != 0:
            (keep / f"run{i}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
        print(f"run {i + 1}/{args.runs}: exit {proc.returncode}", file=sys.stderr, flush=True)
    clean = sum(s == 0 for s in statuses)
    report = {
        "runs": args.runs,
        "exit_0": clean,
        "statuses": statuses,
        "extra": args.extra,
        "wall_seconds": round(time.perf_counter() - began, 1),
        "failed_logs": str(keep),
    }
    print(json.dumps(report, indent=2))
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
