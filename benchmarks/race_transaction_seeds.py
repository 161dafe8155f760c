"""auto's in-run race against the same seed's race aside: does racing as the run's own steps cost the model?

    python -m benchmarks.race_transaction_seeds                       # seeds 1-10, 2 epochs, 2 runs at a time
    python -m benchmarks.race_transaction_seeds --seeds 1-3 --jobs 1 --json seeds.json -- --epochs 3
    python -m benchmarks.race_transaction_seeds --only in-run --against seeds.json   # the aside runs reused

Per seed, two fresh runs of the main job (``mixprec train --epochs 2 --seed S``, ``MIXPREC_AUTO_CACHE=0``: each
races afresh; one torch thread each): auto racing in-run (the default for a run of 100 steps or more) and
auto racing aside (``MIXPREC_AUTO_RACE=aside``, whose run is bit-identical to naming the chosen mode). The two
runs of a seed start together (``--jobs 2``), so a neighbour's load falls on both. The in-run race's first
steps mix the candidates; since issue 34's rewind the Trainer then goes back to before them and takes them again
in the chosen mode (trainer/race_rewind.py), so where both races choose the same mode the runs should be
bit-identical. Reports each seed's validation losses (the run's own ``run.json``), the modes each
chose, the in-run race's steps and skipped steps, and the gap ``in-run / aside - 1``; the verdict is issue 34's
goal: median absolute gap <= 0.3%, none over 1%. Arguments after ``--`` go to every ``mixprec train``. The aside
path is untouched by the in-run race's changes: ``--only in-run --against FILE`` runs the in-run half only and
takes each seed's aside run from ``FILE`` (what ``--json`` wrote, or the same shape by hand from a table).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

GOAL_MEDIAN = 0.003
GOAL_MAX = 0.01


def run_once(seed: int, race: str, folder: Path, extra: list[str]) -> dict[str, Any]:
    env = dict(os.environ, MIXPREC_AUTO_CACHE="0", MIXPREC_AUTO_RACE=race, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "mixprec.cli.main",
        "train",
        "--epochs",
        "2",
        "--seed",
        str(seed),
        "--output-dir",
        str(folder),
        *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    record = json.loads((folder / "run.json").read_text())
    summary = record["summary"]
    decision = summary.get("auto_precision") or {}
    return {
        "chosen": summary.get("precision"),
        "eval_loss": record["eval_loss"],
        "skipped_steps": summary.get("skipped_steps", 0),
        "race_steps": decision.get("in_run_steps", 0),
        "replayed_steps": decision.get("replayed_steps", 0),
        # the race's cost (its steps' time over the chosen mode's, and the replay's), against the run's time
        "race_seconds": decision.get("cost_seconds", 0.0),
        "replay_seconds": decision.get("replay_seconds", 0.0),
        "train_runtime": summary.get("train_runtime"),
    }


def _seeds(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1-10", help="seeds: a range 1-10 or a list 1,4,7 (default: 1-10)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default: 2)")
    parser.add_argument("--json", help="also write the table as JSON to this file")
    parser.add_argument("--only", choices=["in-run"], help="run the in-run half only (needs --against)")
    parser.add_argument("--against", help="a JSON file of earlier rows (--json's): their aside runs are reused")
    args = parser.parse_args(argv)
    seeds = _seeds(args.seeds)
    earlier = {}
    if args.only:
        if not args.against:
            parser.error("--only in-run needs --against FILE: the aside runs to compare with")
        earlier = {row["seed"]: row["aside"] for row in json.loads(Path(args.against).read_text())["rows"]}
        if [seed for seed in seeds if seed not in earlier]:
            parser.error(f"--against {args.against}: no aside run for seeds {[s for s in seeds if s not in earlier]}")
    races = ("in-run",) if args.only else ("in-run", "aside")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; seeds {seeds}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [
            (seed, race, pool.submit(run_once, seed, race, Path(tmp) / f"{race}-{seed}", extra))
            for seed in seeds
            for race in races
        ]
        results: dict[tuple[int, str], dict[str, Any]] = {}
        for seed, race, future in jobs:
            results[seed, race] = future.result()
            if args.only:
                results[seed, "aside"] = earlier[seed]
            if race == races[-1]:
                inrun, aside = results[seed, "in-run"], results[seed, "aside"]
                row = {
                    "seed": seed,
                    "in_run": inrun,
                    "aside": aside,
                    "gap": inrun["eval_loss"] / aside["eval_loss"] - 1,
                }
                rows.append(row)
                print(
                    f"seed {seed:2d}: in-run {inrun['eval_loss']:.4f} ({inrun['chosen']}, {inrun['race_steps']} race "
                    f"steps, {inrun.get('replayed_steps', 0)} replayed, {inrun['skipped_steps']} skipped)  "
                    f"aside {aside['eval_loss']:.4f} ({aside['chosen']})  "
                    f"gap {row['gap']:+.2%}",
                    flush=True,
                )
    gaps = [abs(r["gap"]) for r in rows]
    median, worst = statistics.median(gaps), max(gaps)
    held = median <= GOAL_MEDIAN and worst <= GOAL_MAX
    print(
        f"median |gap| {median:.2%} (goal <= {GOAL_MEDIAN:.1%}), max {worst:.2%} (goal <= {GOAL_MAX:.0%}): "
        f"{'met' if held else 'not met'}"
    )
    same = [abs(r["gap"]) for r in rows if r["in_run"]["chosen"] == r["aside"]["chosen"]]
    # where the two races chose different modes (the op timing's policy differs under load), the gap is partly
    # the modes' own: the seeds where both chose alike isolate what racing in-run costs
    print(
        f"same mode chosen in {len(same)} of {len(rows)} seeds"
        + (f"; among them median |gap| {statistics.median(same):.2%}, max {max(same):.2%}" if same else "")
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median_gap": median, "max_gap": worst}, indent=2))
    return 0 if held else 1


if __name__ == "__main__":
    raise SystemExit(main())
