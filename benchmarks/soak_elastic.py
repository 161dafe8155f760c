"""Soak: elastic restarts under torchrun end exactly where an uninterrupted run ends.

    PYTHONPATH=src:. python benchmarks/soak_elastic.py [--trials 20] [--seed 0] [--rdzv static|c10d]

One uninterrupted 2-process run (tests/strategies/elastic_worker.py: DDP over gloo, fp16, dropout, 12 steps, a
checkpoint every 3), then TRIALS runs under ``torchrun --max-restarts=3`` in which a random rank SIGKILLs itself once at
a random step (1..11). A trial passes when the launcher exits 0, the worker group was restarted, and both
ranks' final parameters are bit-identical to the uninterrupted run's. Loopback only (127.0.0.1).
Prints one line per trial and a summary; exits 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "strategies" / "elastic_worker.py"
STEPS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, rdzv: str, env_extra: dict[str, str], restarts: int) -> int:
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), **env_extra)
    port = _free_port()
    where = (
        ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=soak", "--local-addr=127.0.0.1"]
        if rdzv == "c10d"
        else ["--master_addr=127.0.0.1", f"--master_port={port}"]
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--max-restarts={restarts}",
        *where,
        str(WORKER),
        str(out),
    ]
    with open(out / "launcher.log", "w") as log:
        try:
            return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300).returncode
        except subprocess.TimeoutExpired:
            return -1


def params(out: Path, rank: int) -> dict | None:
    path = out / f"final_rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rdzv", choices=("static", "c10d"), default="static")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="soak_elastic_") as tmp:
        root = Path(tmp)
        if launch(root / "reference", args.rdzv, {}, 0) != 0:
            print((root / "reference" / "launcher.log").read_text()[-3000:])
            return 1
        reference = [params(root / "reference", r)["params"] for r in (0, 1)]
        passed, seconds = 0, []
        for trial in range(args.trials):
            rank, step = rng.randrange(2), rng.randrange(1, STEPS)
            out = root / f"trial{trial}"
            start = time.monotonic()
            rc = launch(out, args.rdzv, {"ELASTIC_KILL": f"{rank}:{step}"}, 3)
            seconds.append(time.monotonic() - start)
            finals = [params(out, r) for r in (0, 1)]
            ok = (
                rc == 0
                and (out / "killed").exists()
                and all(f is not None and f["restart"] >= 1 for f in finals)
                and [f["params"] for f in finals] == reference
            )
            passed += ok
            resumed = finals[0]["first_step"] if finals[0] else None
            print(
                f"trial {trial:2d}: kill rank {rank} at step {step:2d}: rc={rc} resumed at step {resumed} "
                f"{'identical' if ok else 'FAILED'} ({seconds[-1]:.1f} s)",
                flush=True,
            )
            if not ok:
                print((out / "launcher.log").read_text()[-2000:])
        seconds.sort()
        print(
            f"{passed}/{args.trials} trials completed with final weights bit-identical to the uninterrupted run "
            f"(rdzv {args.rdzv}; median {seconds[len(seconds) // 2]:.1f} s per trial)"
        )
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
