"""Does precision="auto" pick the fastest mode on *this* machine? Three workloads, each measured in one run.

    python -m benchmarks.bench_auto                          # all three workloads (several minutes)
    python -m benchmarks.bench_auto --only mlp --rounds 8    # one of: bench, gpt2, mlp
    python -m benchmarks.bench_auto --json auto.json
    python -m benchmarks.bench_auto --repeat 10 --neighbour   # does the verdict agree with itself? (issue 29)

- ``bench``: ``mixprec bench``'s default workload (the built-in small GPT, batch 4 x 64, one thread);
- ``gpt2``: ``mixprec bench --model gpt2 --batch-size 2 --seq-len 128`` (GPT-2 124M from its config);
- ``mlp``: a hand-written Accelerator loop over a wide MLP (4 x Linear(1024), batch 256, the threads torch
  has): one Accelerator per mode, fp32 / bf16 / fp16 by name and "auto", which races at its first forward.

For the first two, ``mixprec bench`` times every mode in interleaved rounds and "auto" shares the run of the
mode it chose, so the verdict is ``auto's mode's median / the fastest candidate's median``. For the MLP the
four arms (auto's included, after its race) run interleaved rounds of ``--steps`` steps; the verdict is auto's
median over the fastest named mode's. Goal: within 5% (``AUTO_TOLERANCE``). Also reported: what the race
measured and what it cost.

``--repeat N``: N fresh races (no cache) of the default ``mixprec train`` step (the small GPT, batch 16 x 128
of the embedded corpus, the threads train would choose), and how many agree with the most common choice;
with ``--neighbour`` the same N again beside a busy process this script starts (one thread of 512 x 512
matmuls in a loop) and stops. ``--clock wall`` races on the wall clock instead of the thread's CPU time, to
compare. Goal: N/N agree in each condition.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from typing import Any

import torch

from mixprec import Accelerator
from mixprec.bench.result import AUTO_TOLERANCE


def bench_workload(flags: list[str], steps: int, rounds: int, precisions: str | None = None) -> dict[str, Any]:
    """``mixprec bench <flags> --json`` in this process; its JSON document."""
    from mixprec.cli.main import main as cli

    out = io.StringIO()
    argv = ["bench", *flags, "--steps", str(steps), "--rounds", str(rounds), "--no-memory", "--json"]
    if precisions:
        argv += ["--precisions", precisions]
    with contextlib.redirect_stdout(out):
        code = cli(argv)
    if code != 0:
        raise RuntimeError(f"mixprec {' '.join(argv)} exited with {code}")
    data = json.loads(out.getvalue())
    return {
        "command": "mixprec " + " ".join(argv),
        "workload": data["workload"],
        "medians_ms": {r["precision"]: r["step_time_s"] * 1e3 for r in data["results"] if r["step_time_s"]},
        "verdict": data["auto"],
        "race": data["auto_race"],
    }


class WideMLP(torch.nn.Module):
    def __init__(self, width: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.layers(x).float(), y)}


def mlp_loop(steps: int, rounds: int, batch: int = 256, width: int = 1024) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(4)]
    arms: dict[str, Any] = {}
    for name in ("fp32", "bf16", "fp16", "auto"):
        torch.manual_seed(0)
        acc = Accelerator(mixed_precision=name, verbose=False)
        model = WideMLP(width)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        arms[name] = {"acc": acc, "model": model, "opt": opt, "times": [], "i": 0}

    def step(arm: dict[str, Any]) -> None:
        x, y = data[arm["i"] % len(data)]
        arm["i"] += 1
        arm["acc"].backward(arm["model"](x, y)["loss"])
        arm["opt"].step()
        arm["opt"].zero_grad()

    t0 = time.perf_counter()
    step(arms["auto"])  # auto's first step: the race, then the step in the chosen mode
    race_wall = time.perf_counter() - t0
    for name, arm in arms.items():  # warm-up
        if name != "auto":
            step(arm)
    order = list(arms)
    for r in range(rounds):
        for name in order[r % 4 :] + order[: r % 4]:
            arm = arms[name]
            t = time.perf_counter()
            for _ in range(steps):
                step(arm)
            arm["times"].append((time.perf_counter() - t) / steps)
    medians = {name: statistics.median(arm["times"]) * 1e3 for name, arm in arms.items()}
    named = {k: v for k, v in medians.items() if k != "auto"}
    fastest = min(named, key=named.get)
    ratio = medians["auto"] / named[fastest]
    decision = arms["auto"]["acc"].auto_decision
    return {
        "workload": f"Accelerator loop, {len(arms['fp32']['model'].layers)} x Linear({width}), batch {batch}, "
        f"{torch.get_num_threads()} threads",
        "medians_ms": medians,
        "verdict": {
            "chose": decision.chosen,
            "fastest": fastest,
            "ratio_to_fastest": ratio,
            "within_tolerance": ratio <= 1 + AUTO_TOLERANCE,
            "tolerance": AUTO_TOLERANCE,
        },
        "race": decision.to_dict(),
        "first_step_with_race_s": race_wall,
    }


NEIGHBOUR = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).tanh()\n"


def train_step_races(repeat: int, clock: str, threads: int | None) -> dict[str, Any]:
    """``repeat`` fresh races of the default ``mixprec train`` step; each one's choice, interval and cost."""
    import argparse as _argparse
    import copy

    from mixprec.cli import _threads
    from mixprec.cli._common import load_model_and_data
    from mixprec.cli.train import DEFAULT_BATCH_SIZE, DEFAULT_SEQ_LEN

    chosen_threads = threads or _threads.choose_threads().threads
    torch.set_num_threads(chosen_threads)
    ns = _argparse.Namespace(precision="auto", seed=42, batch_size=DEFAULT_BATCH_SIZE, seq_len=DEFAULT_SEQ_LEN)
    model, train, _, info = load_model_and_data(ns)
    batch = {k: torch.stack([train[i][k] for i in range(DEFAULT_BATCH_SIZE)]) for k in train[0]}
    runs = []
    for _ in range(repeat):
        acc = Accelerator(mixed_precision="auto", verbose=False)
        m = copy.deepcopy(model)
        m, _opt = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
        kwargs = {"clock": time.perf_counter} if clock == "wall" else {}
        d = acc.precision.settle(  # pending: the "auto" strategy itself
            lambda m=m: m(**batch).loss, [m], batch=batch, use_cache=False, run_steps=300, in_run=False, **kwargs
        )
        runs.append(
            {
                "chosen": d.chosen,
                "speedups": d.speedups(),
                "interval": d.speedup_interval,
                "rounds": d.rounds,
                "dropped": d.dropped,
                "cost_s": d.cost_seconds,
            }
        )
    choices = [r["chosen"] for r in runs]
    top = max(set(choices), key=choices.count)
    return {
        "workload": f"mixprec train's step: {info.model_description}, batch {DEFAULT_BATCH_SIZE} x {info.seq_len}, "
        f"{chosen_threads} thread(s), {clock} clock",
        "choices": choices,
        "agreement": f"{choices.count(top)}/{len(choices)} chose {top}",
        "runs": runs,
    }


def repeat_main(args: argparse.Namespace) -> dict[str, Any]:
    import subprocess
    import sys

    out: dict[str, Any] = {"quiet": train_step_races(args.repeat, args.clock, args.threads)}
    if args.neighbour:
        proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
        try:
            time.sleep(1.0)
            out["beside a busy neighbour"] = train_step_races(args.repeat, args.clock, args.threads)
        finally:
            proc.kill()
            proc.wait()
    for condition, r in out.items():
        print(f"{condition}: {r['workload']}\n  agreement: {r['agreement']}")
        for run in r["runs"]:
            sp = ", ".join(f"{k} {v:.2f}x" for k, v in run["speedups"].items())
            iv = ", ".join(f"{k} {lo:.2f}-{hi:.2f}x" for k, (lo, hi) in run["interval"].items())
            print(
                f"    {run['chosen']:<5} {sp}; 95% interval {iv or '-'}; {run['rounds']} rounds; "
                f"race {run['cost_s']:.1f}s" + (f"; dropped {run['dropped']}" if run["dropped"] else "")
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("bench", "gpt2", "mlp"), action="append")
    p.add_argument("--steps", type=int, default=2, help="timed steps per arm per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the results here too")
    p.add_argument(
        "--gpt2-precisions",
        default=None,
        help="the modes timed on GPT-2 (default: fp32,fp16,bf16,auto); e.g. fp32,bf16,auto where emulated fp16 "
        "takes minutes a step (auto's own race still tries fp16 and reports it)",
    )
    p.add_argument("--repeat", type=int, default=0, help="N fresh races of mixprec train's step: their agreement")
    p.add_argument("--neighbour", action="store_true", help="with --repeat: again beside a busy process")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="with --repeat: the race's clock")
    p.add_argument("--threads", type=int, default=None, help="with --repeat: torch threads (default: train's)")
    args = p.parse_args(argv)
    if args.repeat:
        result = repeat_main(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    chosen = args.only or ["bench", "gpt2", "mlp"]
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if "bench" in chosen:
        out["bench"] = bench_workload([], args.steps, args.rounds)
    if "gpt2" in chosen:
        gpt2 = ["--model", "gpt2", "--batch-size", "2", "--seq-len", "128"]
        out["gpt2"] = bench_workload(gpt2, args.steps, args.rounds, args.gpt2_precisions)
    if "mlp" in chosen:
        out["mlp"] = mlp_loop(args.steps, args.rounds)
    for key in chosen:
        r = out[key]
        v = r["verdict"]
        medians = ", ".join(f"{k} {t:.1f} ms" for k, t in r["medians_ms"].items())
        state = "within" if v["within_tolerance"] else "NOT within"
        print(
            f"{key}: {r['workload']}\n  medians: {medians}\n  auto chose {v['chose']}: "
            f"{v['ratio_to_fastest']:.3f}x the fastest ({v['fastest']}), {state} {v['tolerance']:.0%}; "
            f"the race took {r['race']['cost_seconds']:.2f}s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
