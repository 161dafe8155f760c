"""auto on a short run: the Trainer example of issue 36 under auto against its fixed modes (issue 36, item 3).

    python -m benchmarks.bench_short_race                       # 3 interleaved rounds, fp32 / bf16 / policy / auto
    python -m benchmarks.bench_short_race --rounds 5 --variants bf16,auto --json short.json
    python -m benchmarks.bench_short_race --variants hf:bf16,bf16                 # against HF's own Trainer

A variant ``hf:<mode>`` (``hf:fp32``, ``hf:bf16``) runs the same example with transformers' own Trainer
(``bf16=True`` for ``hf:bf16``), for issue 36's "mixprec bf16 no slower than HF's Trainer bf16".

GPT2LMHeadModel from a 4-layer, 256-wide config (vocab 512), 60 optimizer steps of 8 x 256 random tokens,
mixprec's Trainer with ``use_cpu=True`` and 2 threads, no evaluation, no saves. Each variant runs in a fresh
process (``MIXPREC_AUTO_CACHE=0``: auto's first run, no cache), the variants interleaved round by round (a
neighbour's burst slows one round of each, not one variant). Reported per variant: the median and the range of
``trainer.train()``'s wall seconds, its ratio to the best fixed mode's median, and for auto its choice and what
its race cost (the summary's "race" seconds, and the training steps it ran as). On a shared machine the spread is
as informative as the median: read the ratio with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FIXED = ("fp32", "bf16", "bf16:fp32_ops=attention")


def one(precision: str, threads: int, steps: int, out_dir: str) -> dict[str, Any]:
    """One run of the example in this process; its wall seconds and what the summary says of the race."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from mixprec import Trainer, TrainingArguments

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=256)
    model = GPT2LMHeadModel(config)
    data = torch.randint(0, 512, (steps * 8, 256), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": x, "labels": x} for x in data]
    if precision.startswith("hf:"):  # transformers' own Trainer on the same example
        import transformers

        Trainer, TrainingArguments = transformers.Trainer, transformers.TrainingArguments
        mode = {"bf16": precision == "hf:bf16"}
    else:
        mode = {"precision": precision}
    args = TrainingArguments(
        output_dir=out_dir,
        **mode,
        max_steps=steps,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        learning_rate=3e-4,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    start = time.perf_counter()
    out = trainer.train()
    wall = time.perf_counter() - start
    summary = out.metrics
    auto = summary.get("auto_precision") or {}
    return {
        "precision": precision,
        "wall_s": round(wall, 3),
        "chosen": summary.get("precision", precision),
        "race_s": summary.get("time", {}).get("run_seconds", {}).get("race", 0.0),
        "race_steps": auto.get("in_run_steps", 0),
        "rounds": auto.get("rounds", 0),
        "op_timing": auto.get("op_timing", ""),
    }


def spawn(precision: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "MIXPREC_AUTO_CACHE": "0", "OMP_NUM_THREADS": str(args.threads)}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_short_race",
        "--one",
        precision,
        "--threads",
        str(args.threads),
        "--steps",
        str(args.steps),
        "--out",
        str(out_dir),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{precision}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join((*FIXED, "auto")), help="comma-separated precisions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run one variant, print JSON
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.threads, args.steps, args.out)))
        return
    import tempfile

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:  # rotated: no fixed order
                runs[v].append(spawn(v, args, Path(tmp) / f"{r}-{v.replace(':', '_')}"))
                print(f"round {r + 1} {v}: {runs[v][-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)
    median = {v: statistics.median(x["wall_s"] for x in rs) for v, rs in runs.items()}
    fixed = [v for v in variants if v != "auto"]
    best = min(fixed, key=median.__getitem__) if fixed else None
    print(
        f"Trainer example: GPT-2 4 x 256, vocab 512, {args.steps} steps of 8 x 256, {args.threads} threads, "
        f"{args.rounds} interleaved rounds (medians; a shared machine: read the ranges too)"
    )
    for v, rs in runs.items():
        walls = sorted(x["wall_s"] for x in rs)
        ratio = f"{median[v] / median[best]:.3f}x best fixed ({best})" if best else ""
        line = f"  {v:<24} {median[v]:7.2f} s  ({walls[0]:.2f}-{walls[-1]:.2f})  {ratio}"
        if v == "auto":
            chosen = ", ".join(sorted({x["chosen"] for x in rs}))
            races = ", ".join(f"{x['race_s']:.2f}" for x in rs)
            steps = ", ".join(str(x["race_steps"]) for x in rs)
            line += f"\n    chose {chosen}; race s {races}; race steps {steps}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
