"""Does a checkpoint slow the steps after it? The training step before and after one ``save_state(async_save=True)``.

Each round is a fresh process (``--threads`` intra-op threads, 2 by default, as ``mixprec train`` on two cores):
the main job's model and batch (built-in GPT "small", 16 x 128) under ``--precision``, fused AdamW, warm-up
steps, then ``--steps`` timed steps, one asynchronous save (waited for), ``--steps`` timed steps again. Reports
per round the median step before and after, and the median over rounds of the ratio after / before (1.00: the
save leaves nothing behind).

Found in issue 36: the writer thread's parallel copy gave it an OpenMP team of its own, and with more OpenMP
threads than cores every later op of the training thread paid a wake-up (the ratio was ~1.3-1.5 on a 2-core
Xeon). To compare code versions, put the other version's ``src`` first on ``PYTHONPATH``; the rounds inherit it.

    python -m benchmarks.bench_after_save                           # bf16 with attention in fp32, 5 rounds
    python -m benchmarks.bench_after_save --precision fp32 --rounds 3
    PYTHONPATH=<old checkout>/src python -m benchmarks.bench_after_save
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from mixprec import Accelerator
from mixprec.models import GPT


def one_round(precision: str, steps: int, folder: str) -> dict[str, float]:
    """In this process: median step seconds before and after one asynchronous save."""
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=precision, cpu=True, verbose=False)
    model = GPT.from_preset("small")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.randint(0, 256, (16, 128))

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            accelerator.backward(model(batch, labels=batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out.append(time.perf_counter() - start)
        return out

    timed(5)  # warm-up: allocator, kernels
    before = statistics.median(timed(steps))
    accelerator.save_state(folder, async_save=True)
    accelerator.wait_for_checkpoint()
    after = statistics.median(timed(steps))
    return {"before_ms": before * 1e3, "after_ms": after * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="bf16:fp32_ops=attention")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps before and after the save")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each round's process")
    parser.add_argument("--json", help="also write the rounds and medians to this file")
    parser.add_argument("--round", action="store_true", help=argparse.SUPPRESS)  # a child: one round, JSON out
    args = parser.parse_args(argv)
    if args.round:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one_round(args.precision, args.steps, os.path.join(tmp, "ck"))))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    child = [sys.executable, "-m", "benchmarks.bench_after_save", "--round"]
    child += ["--precision", args.precision, "--steps", str(args.steps)]
    rounds = []
    for r in range(args.rounds):
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        rounds.append(json.loads(done.stdout.splitlines()[-1]))
        ratio = rounds[-1]["after_ms"] / rounds[-1]["before_ms"]
        print(
            f"round {r + 1}/{args.rounds}: before {rounds[-1]['before_ms']:.1f} ms, after {rounds[-1]['after_ms']:.1f} "
            f"ms a step ({ratio:.2f}x)",
            flush=True,
        )
    ratio = statistics.median(x["after_ms"] / x["before_ms"] for x in rounds)
    before = statistics.median(x["before_ms"] for x in rounds)
    after = statistics.median(x["after_ms"] for x in rounds)
    print(
        f"{args.precision}, {args.threads} threads, torch {torch.__version__}: step before the save {before:.1f} ms, "
        f"after {after:.1f} ms; median ratio after / before {ratio:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "ratio": ratio, "before_ms": before, "after_ms": after}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
