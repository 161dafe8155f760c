"""The precision watch's cost on the default `mixprec train` model, as a ratio of step times.

Three copies of the default model (``GPT.from_preset("small")``, batch 16 x 128 bytes, AdamW, the CLI's
default precision "auto" unless ``--precision``) train side by side, each prepared by its own Accelerator:

- ``plain``: no watch;
- ``hooked``: a watch that never samples (``every`` = 10^9): what every step pays, the one forward pre-hook
  that follows the steps and keeps the batch and the RNG state for a possible replay;
- ``sampled``: a watch that samples every step (``every=1``): what a sampled step costs.

After a warm-up, rounds interleave the three (the order rotates each round, so a noisy neighbour hurts all
alike); each round times one step per variant by default (medians over many single steps resist the shared
machine's bursts better than a few long blocks). From the medians over rounds, the watch's overhead at
interval N is the mean step time of N - 1 hooked steps and one sampled step over N plain steps:

    overhead(N) = ((N - 1) * hooked + sampled) / (N * plain) - 1           (goal at the default N: <= 2%)

reported at the default interval (``mixprec.watch.DEFAULT_EVERY``) and a few others, with each ratio's
spread over rounds. Time is this process's CPU time with one torch thread unless asked otherwise.

    python -m benchmarks.bench_watch                    # ~1-2 minutes on the shared 2-core dev box
    python -m benchmarks.bench_watch --rounds 3         # a quick look
    python -m benchmarks.bench_watch --json out.json    # also write the figures
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

import mixprec
from mixprec.models import GPT
from mixprec.watch import DEFAULT_EVERY, PrecisionWatch

BATCH, SEQ = 16, 128  # `mixprec train`'s defaults (cli/train.py)
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
NEVER = 10**9


class Variant:
    def __init__(self, name: str, precision: str, watch: PrecisionWatch | None) -> None:
        self.name = name
        torch.manual_seed(0)
        model = GPT.from_preset("small")
        self.acc = mixprec.Accelerator(mixed_precision=precision, cpu=True, watch=watch, verbose=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.model, self.opt = self.acc.prepare(model, opt)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        self.batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def step(self) -> None:
        loss = self.model(**self.batch).loss
        self.acc.backward(loss)
        self.opt.step()
        self.opt.zero_grad()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", default="auto", help="as `mixprec train --precision` (default: auto)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]

    variants = [
        Variant("plain", args.precision, None),
        Variant("hooked", args.precision, PrecisionWatch(every=NEVER)),
        Variant("sampled", args.precision, PrecisionWatch(every=1)),
    ]
    precision = variants[0].acc.mixed_precision
    for v in variants:
        for _ in range(args.warmup):
            v.step()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % 3 :] + variants[: r % 3]
        for v in order:
            start = clock()
            for _ in range(args.steps):
                v.step()
            times[v.name].append((clock() - start) / args.steps)
    # a sampled step is read back when the next step begins, so each block also pays the previous one's last
    variants[2].acc.watch.close()
    assert variants[2].acc.watch.summary()["samples"] == args.warmup + args.rounds * args.steps

    med = {k: statistics.median(v) for k, v in times.items()}

    def overhead(n: int, plain: float, hooked: float, sampled: float) -> float:
        return ((n - 1) * hooked + sampled) / (n * plain) - 1

    intervals = sorted({1, 10, 50, DEFAULT_EVERY, 500})
    per_round = {
        n: [overhead(n, times["plain"][i], times["hooked"][i], times["sampled"][i]) for i in range(args.rounds)]
        for n in intervals
    }
    print(
        f"precision watch overhead, GPT small, batch {BATCH} x {SEQ}, {precision}, {args.threads} thread(s), "
        f"{args.clock} time, {args.rounds} rounds x {args.steps} steps"
    )
    print(f"  cpu: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    for k in ("plain", "hooked", "sampled"):
        print(f"  {k:8s} step {med[k] * 1e3:8.1f} ms  (rounds {min(times[k]) * 1e3:.1f}-{max(times[k]) * 1e3:.1f})")
    hooked, sampled = med["hooked"] / med["plain"], med["sampled"] / med["plain"]
    print(f"  hooked / plain  {hooked:.4f}   sampled / plain  {sampled:.3f}")
    for n in intervals:
        o = overhead(n, med["plain"], med["hooked"], med["sampled"])
        spread = per_round[n]
        mark = "  <- default" if n == DEFAULT_EVERY else ""
        print(
            f"  every {n:4d}: overhead {o * 100:+6.2f}% of medians, {statistics.median(spread) * 100:+6.2f}% "
            f"median of rounds (rounds {min(spread) * 100:+.2f}% .. {max(spread) * 100:+.2f}%){mark}"
        )
    if args.json:
        record = {
            "precision": precision,
            "median_step_s": med,
            "rounds": times,
            "overhead": {str(n): overhead(n, med["plain"], med["hooked"], med["sampled"]) for n in intervals},
            "overhead_median_of_rounds": {str(n): statistics.median(per_round[n]) for n in intervals},
            "default_every": DEFAULT_EVERY,
            "argv": sys.argv[1:],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
