"""What mixprec's loop costs around the step (issue 36): host overhead in ms per step against a hand-written loop.

The model is the built-in ``tiny`` GPT (2 layers, 64 wide; batch 4 x 64 tokens), so small that a step's compute
is a few milliseconds and what the loop adds shows. Every variant does the same work per step: a batch from a
DataLoader, forward under the precision, backward (loss scaling for fp16), clip to 1.0, torch's fused AdamW
(what ``adamw_torch`` builds where torch has the kernel), the learning-rate schedule, zero_grad, and the loss read
on the host every 10 steps (logging):

- ``by hand``: torch.autocast + torch.amp.GradScaler, written out (the floor);
- ``Accelerator``: the same loop through ``mixprec.Accelerator`` (prepare, backward, clip_grad_norm_);
- ``Trainer``: ``mixprec.Trainer`` at its defaults, logging every 10 steps, no evaluation or saves;
- ``CLI``: ``mixprec train --model tiny`` as subprocesses: per round, the CPU time of a run of ``--steps`` + 20
  steps less that of a 20-step run (start-up, the final evaluation, sample and plots cancel), over ``--steps``;
  with ``--clock wall``, the summary's training-steps time.

In-process variants advance in interleaved rounds (rotating order) on one torch thread, timed in the process's
CPU time by default (``--clock cpu``: steadier on a shared box, where wall time measures the neighbours; one
variant runs at a time, so the process's CPU time is that variant's). Reported: each variant's median ms per
step, and its overhead over the hand-written loop as the median of the per-round differences.

    python -m benchmarks.bench_overhead --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import mixprec
from benchmarks import _loops
from mixprec.models import GPT

LOG_EVERY = 10


def _dataset(n: int, seq_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, seq_len), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def by_hand(s: _loops.Setup, model: torch.nn.Module) -> Iterator[None]:
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, fused=True)
    sched = _schedule(opt)
    scaler = torch.amp.GradScaler(s.device.type, enabled=s.precision == "fp16")
    enabled, dtype = s.dtype is not None, s.dtype or torch.bfloat16
    for i, batch in enumerate(s.batches()):
        with torch.autocast(s.device.type, dtype=dtype, enabled=enabled):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i % LOG_EVERY == 0:
            loss.item()
        yield


def accelerator(s: _loops.Setup, model: torch.nn.Module) -> Iterator[None]:
    acc = mixprec.Accelerator(mixed_precision=s.precision, cpu=s.device.type == "cpu", verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, fused=True)
    model, opt, loader, sched = acc.prepare(model, opt, s.loader(), _schedule(opt))
    i = 0
    while True:
        for batch in loader:
            loss = model(**batch).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), s.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if i % LOG_EVERY == 0:
                loss.item()
            i += 1
            yield


def _cli_run(a: argparse.Namespace, steps: int) -> tuple[float, float]:
    """One ``mixprec train --model tiny`` run of ``steps`` steps: (its CPU seconds in all, its training steps'
    wall seconds from its summary)."""
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "mixprec",
            "train",
            "--model",
            "tiny",
            "--seq-len",
            str(a.seq_len),
            "--batch-size",
            str(a.batch_size),
            "--max-steps",
            str(steps),
            "--precision",
            a.precision,
            "--output-dir",
            str(Path(tmp) / "run"),
            "--seed",
            str(a.seed),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MIXPREC_AUTO_CACHE": "0"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        run = Path(tmp) / "run"
        summary = json.loads((run / "train_summary.json").read_text())
        if "time" in summary:
            return cpu, summary["time"]["run_seconds"]["training_steps"]
        evals = [json.loads(line).get("eval_runtime", 0.0) for line in (run / "metrics.jsonl").open()]
        return cpu, summary["train_runtime"] - sum(evals)


def cli_step_ms(a: argparse.Namespace) -> float:
    """The CLI's ms per step. CPU clock: the difference of two whole runs' CPU time (``--steps`` + 20 steps and
    20 steps: start-up, the evaluation at the end, the sample and the plots cancel out) over ``--steps``. Wall
    clock: the summary's training-steps time of the longer run."""
    cpu_long, wall_long = _cli_run(a, a.steps + 20)
    if a.clock == "wall":
        return 1000 * wall_long / (a.steps + 20)
    cpu_short, _ = _cli_run(a, 20)
    return 1000 * (cpu_long - cpu_short) / a.steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="steps per variant per round (and per CLI run)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="in-process timing (default cpu)")
    p.add_argument("--no-cli", action="store_true", help="leave out the CLI's subprocess runs")
    p.add_argument("--json", metavar="PATH", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    device = torch.device("cpu")
    torch.manual_seed(a.seed)
    init = GPT.from_preset("tiny").state_dict()
    s = _loops.Setup(
        "tiny", init, _dataset(512, a.seq_len, a.seed), a.precision, a.batch_size, 1e-3, 1.0, a.seed, device
    )
    total = a.warmup + a.rounds * a.steps
    steppers: dict[str, _loops.Stepper] = {}
    for name, loop in (("by hand", by_hand), ("Accelerator", accelerator)):
        model = s.fresh_model()
        steppers[name] = _loops.GeneratorStepper(name, _loops.DtypeObserver(model), loop(s, model))
    gate, tmp = _loops._Gate(), tempfile.mkdtemp(prefix="bench_overhead_")
    model = s.fresh_model()
    steppers["Trainer"] = _loops.ThreadStepper(
        "Trainer",
        _loops.DtypeObserver(model),
        _loops.mixprec_trainer(s, model, total, gate, tmp, logging_strategy="steps", logging_steps=LOG_EVERY),
        gate,
        tmp,
    )
    names = list(steppers) + ([] if a.no_cli else ["CLI"])
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        for st in steppers.values():
            st.observer.remove()
            st.steps(a.warmup)
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                if name == "CLI":
                    times[name].append(cli_step_ms(a))
                    continue
                t0 = clock()
                steppers[name].steps(a.steps)
                times[name].append(1000 * (clock() - t0) / a.steps)
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f}" for n in names), file=sys.stderr)
    finally:
        for st in steppers.values():
            st.close()
    floor = times["by hand"]
    rows = {}
    for name in names:
        diffs = [t - f for t, f in zip(times[name], floor, strict=True)]
        rows[name] = {
            "ms_per_step": statistics.median(times[name]),
            "range": [min(times[name]), max(times[name])],
            "overhead_ms": statistics.median(diffs),
            "ratio": statistics.median([t / f for t, f in zip(times[name], floor, strict=True)]),
        }
    load = os.getloadavg()[0]
    print(
        f"\nbench_overhead: tiny GPT, {a.batch_size} x {a.seq_len}, {a.precision}, {a.threads} thread(s), "
        f"{a.rounds} rounds of {a.steps} steps, {a.clock} clock, torch {torch.__version__}, "
        f"load average {load:.1f}"
    )
    print(f"{'variant':<12} {'ms/step':>9} {'range':>17} {'vs hand':>8} {'overhead':>10}")
    for name, row in rows.items():
        lo, hi = row["range"]
        print(
            f"{name:<12} {row['ms_per_step']:>9.2f} {lo:>8.2f}-{hi:<8.2f} {row['ratio']:>7.3f}x "
            f"{row['overhead_ms']:>+8.2f} ms"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
