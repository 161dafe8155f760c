"""The main job, whole: ``mixprec train`` on its embedded default, one precision against another, interleaved.

    python -m benchmarks.bench_main_job                                  # auto vs fp32, 3 rounds (~5 min)
    python -m benchmarks.bench_main_job --rounds 5 --threads 2 --json main_job.json
    python -m benchmarks.bench_main_job --precisions fp32,bf16,auto -- --max-steps 100

Each round runs ``mixprec train`` once per precision, as separate processes, in an order that rotates from
round to round, each in a fresh run folder (``MIXPREC_AUTO_CACHE=0``: every "auto" run races afresh, its race
counted in its time). Per precision: the median over rounds of the run's training tokens/s (the run's own
summary: tokens over training time, the race included) and of its validation loss; and, as the verdict, the
median over rounds of each round's paired ratio to the first precision's tokens/s, robust to the machine
getting slower mid-run. Issue 23's goal for the default job: auto >= 1.35x fp32's tokens/s at a validation
loss within 1%. ``--threads N`` pins torch's threads (OMP_NUM_THREADS) so every run gets the same; without it
each run chooses by the cores free at its start, as ``mixprec train`` does for a user.
Arguments after ``--`` go to every ``mixprec train``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_SPEEDUP = 1.35
GOAL_LOSS = 0.01


def run_once(precision: str, folder: Path, extra: list[str], threads: int | None) -> dict[str, Any]:
    env = dict(os.environ, MIXPREC_AUTO_CACHE="0")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "mixprec.cli.main", "train", "--precision", precision, "--output-dir", str(folder)]
    start = time.perf_counter()
    done = subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    record = json.loads((folder / "run.json").read_text())
    summary = record["summary"]
    out = {
        "precision": precision,
        "chosen": summary.get("precision"),
        "tokens_per_s": summary["train_tokens_per_second"],
        "train_runtime": summary.get("train_runtime"),
        "eval_loss": record["eval_loss"],
        "wall_s": round(wall, 2),
    }
    decision = summary.get("auto_precision") or {}
    if decision:  # what auto's race cost: the op timing's replays + the race (aside: its trials; in-run: the excess)
        cost = decision.get("op_timing_seconds", 0.0) + decision.get("cost_seconds", 0.0)
        out["race_cost_s"] = round(cost, 2)
        out["race_share"] = round(cost / summary["train_runtime"], 4) if summary.get("train_runtime") else None
        out["race_steps"] = decision.get("in_run_steps", 0)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,auto", help="comma-separated; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="pin OMP_NUM_THREADS for every run")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    args = parser.parse_args(own)
    names = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if len(names) < 2:
        parser.error("--precisions: name at least two, the baseline first (e.g. fp32,auto)")
    runs: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="main-job-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            row = {}
            for name in order:
                row[name] = run_once(name, Path(tmp) / f"r{r}-{name.replace(':', '_')}", extra, args.threads)
                print(f"round {r + 1}/{args.rounds} {name}: {row[name]}", flush=True)
            runs.append([row[n] for n in names])
    base = names[0]
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.rounds} rounds, interleaved")
    print(f"| precision | chosen | tokens/s (median) | vs {base} (median paired ratio) | val loss (median) |")
    print("|---|---|---|---|---|")
    verdict = {}
    base_loss = statistics.median(row[0]["eval_loss"] for row in runs)
    for i, name in enumerate(names):
        arm = [row[i] for row in runs]
        ratio = statistics.median(row[i]["tokens_per_s"] / row[0]["tokens_per_s"] for row in runs)
        loss = statistics.median(a["eval_loss"] for a in arm)
        chosen = sorted({a["chosen"] for a in arm})
        tps = statistics.median(a["tokens_per_s"] for a in arm)
        print(f"| {name} | {', '.join(chosen)} | {tps:,.0f} | {ratio:.2f}x | {loss:.4f} |")
        verdict[name] = {"ratio": ratio, "eval_loss": loss, "loss_vs_base": loss / base_loss - 1, "chosen": chosen}
    if "auto" in names:
        costs = [row[names.index("auto")] for row in runs]
        shares = [a["race_share"] for a in costs if a.get("race_share") is not None]
        if shares:
            spent = ", ".join(f"{a['race_cost_s']:.2f} s" for a in costs)
            print(
                f"\nauto's race (op timing + race): {spent}; share of "
                f"the run's training time {min(shares):.1%}-{max(shares):.1%} (goal <= 3%); "
                f"race steps {[a.get('race_steps') for a in costs]}"
            )
    if "auto" in names and base == "fp32":
        auto = verdict["auto"]
        ok = auto["ratio"] >= GOAL_SPEEDUP and abs(auto["loss_vs_base"]) <= GOAL_LOSS
        print(
            f"\nauto vs fp32: {auto['ratio']:.2f}x tokens/s (goal >= {GOAL_SPEEDUP}x), validation loss "
            f"{auto['loss_vs_base']:+.2%} (goal within {GOAL_LOSS:.0%}): {'met' if ok else 'NOT met'}"
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "verdict": verdict}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
