"""What "auto"'s race costs: as trials aside from training, or as the run's own first steps (issue 23).

    python -m benchmarks.bench_race_cost                                 # GPT-2 124M, batch 2 x 128, 1 thread
    python -m benchmarks.bench_race_cost --model small --batch 16 --seq 128 --threads 2   # the main job's step
    python -m benchmarks.bench_race_cost --races in-run --json race.json

A hand-written Accelerator loop (AdamW, one random batch) with ``mixed_precision="auto"``, once per race kind
(``MIXPREC_AUTO_RACE``; no cache), each in a fresh Accelerator: it trains until auto has decided. Reported per
kind: the choice, the per-op-kind timing's seconds (the policy candidate's replays, before the race), the race's
own cost (aside: the wall seconds of its trials; in-run: its steps' time over the chosen mode's median, on the
race's clock), their sum, the training steps the race ran as, and the run length (in steps of the chosen mode)
of which that sum is 3% (issue 23's bound: <= 3% of the run and <= 10 s, GPT-2 124M on a CPU included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import torch


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, int]:
    torch.manual_seed(seed)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config()), 50257  # 124M parameters, random weights: nothing downloaded
    from mixprec.models import GPT

    return GPT.from_preset(name), 256


def one(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from mixprec import Accelerator

    os.environ["MIXPREC_AUTO_RACE"] = kind
    model, vocab = build(args.model)
    accelerator = Accelerator(mixed_precision="auto", verbose=False, cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    start, steps = time.perf_counter(), 0
    while accelerator.auto_decision is None and steps < args.max_steps:
        accelerator.backward(model(batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    wall = time.perf_counter() - start
    d = accelerator.auto_decision
    if d is None:
        raise RuntimeError(f"{kind}: no decision within --max-steps {args.max_steps}")
    found = re.search(r"\(([\d.]+) s;", d.op_timing)
    op_s = float(found.group(1)) if found else 0.0
    total = op_s + d.cost_seconds
    chosen_step = d.step_seconds.get(d.chosen, 0.0)
    return {
        "race": kind,
        "chosen": d.chosen,
        "step_ms": {k: round(v * 1e3, 1) for k, v in d.step_seconds.items()},
        "rounds": d.rounds,
        "race_steps": d.in_run_steps,
        "op_timing_s": round(op_s, 2),
        "race_cost_s": round(d.cost_seconds, 2),
        "total_cost_s": round(total, 2),
        "run_steps_for_3pct": round(total / 0.03 / chosen_step) if chosen_step else None,
        "wall_until_decided_s": round(wall, 1),
        "clock": d.clock,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="gpt2 (124M; needs transformers) or a built-in preset")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--races", default="aside,in-run", help="comma-separated: aside, in-run")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("MIXPREC_AUTO_CACHE", "0")
    torch.set_num_threads(args.threads)
    rows = [one(kind.strip(), args) for kind in args.races.split(",") if kind.strip()]
    print(f"{args.model}, batch {args.batch} x {args.seq}, {args.threads} thread(s), {platform.machine()}")
    for r in rows:
        print(
            f"  {r['race']:>6}: chose {r['chosen']}; op timing {r['op_timing_s']:.2f} s + race {r['race_cost_s']:.2f} s"
            f" = {r['total_cost_s']:.2f} s ({r['rounds']} rounds, {r['race_steps']} training steps); 3% of a run "
            f"of {r['run_steps_for_3pct']} steps; decided after {r['wall_until_decided_s']} s; medians {r['step_ms']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
