"""The cost of the watch's numerics checks (issue 26), each on its own, as ratios of step times.

Copies of the default `mixprec train` model (``GPT.from_preset("small")``, batch 16 x 128 bytes, AdamW)
train side by side, each prepared by its own Accelerator:

- ``plain``: no watch;
- ``stagnation``: no watch, but a :class:`~mixprec.watch.stagnation.StagnationProbe` armed on every step
  and read back after it (what a sampled step adds for bf16 stagnation: the weight copy and the compare);
- ``precursors``: no watch, but a :class:`~mixprec.watch.precursors.PrecursorProbe` armed on every step and
  read back (the attention logits recomputed in fp32, log Z of the output);
- ``hooked``: a watch that never samples, spike detection off: what every step paid before issue 26 (the
  forward pre-hook, the batch references and the RNG state a skip replay needs);
- ``capsules``: the same with spike detection on (``spike_factor=3``): the step's loss kept and read after
  the step: what *every* step pays for item 3 (a capsule reuses the skip replay's batch and RNG state);
- ``watch``: the whole watch sampling every step (headroom histograms and both probes).

Rounds interleave the variants (the order rotates), one step each; each variant's ratio to ``plain`` is taken
within a round, and the median of those ratios is reported (robust to the shared machine's bursts). A probe
runs on sampled steps only, so at interval N it costs ``(probe / plain - 1) / N`` of the run; the capsule
check runs on every step, so it costs ``capsules / hooked - 1`` whatever N. The whole watch at N, with every step paying
the capsule check: ``((N - 1) * capsules + watch) / (N * plain) - 1``. Goal: each <= 2% at the default N.

The capsule check's per-step work is a few microseconds, far below the noise of whole-step ratios on a shared
machine, so it is also timed directly: the bookkeeping a step pays (keep the loss, read it, compare with the
median of the recent steps) run 2,000 times on a real step's output, over the plain step's median.

    python -m benchmarks.bench_watch_numerics                  # ~3 minutes on the shared 2-core dev box
    python -m benchmarks.bench_watch_numerics --precision bf16-pure --rounds 20
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
from mixprec.watch.attribution import StepRecorder
from mixprec.watch.badstep import BadSteps
from mixprec.watch.precursors import PrecursorProbe
from mixprec.watch.stagnation import StagnationProbe

BATCH, SEQ = 16, 128
NEVER = 10**9


class Variant:
    def __init__(
        self,
        name: str,
        precision: str,
        watch: PrecisionWatch | None = None,
        probe: type | None = None,
        project_dir: str | None = None,
    ) -> None:
        self.name = name
        torch.manual_seed(0)
        model = GPT.from_preset("small")
        self.acc = mixprec.Accelerator(
            mixed_precision=precision, cpu=True, watch=watch, project_dir=project_dir, verbose=False
        )
        self.model, self.opt = self.acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        self.probe = None
        if probe is StagnationProbe:
            self.probe = StagnationProbe(self.model)
            self.probe.watch_optimizer(self.opt.optimizer)
        elif probe is PrecursorProbe:
            self.probe = PrecursorProbe(self.model)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        self.batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def step(self) -> None:
        if self.probe is not None:
            self.probe.arm()
        loss = self.model(**self.batch).loss
        self.acc.backward(loss)
        self.opt.step()
        self.opt.zero_grad()
        if self.probe is not None:  # the watch reads its probes back at the step's end: one transfer
            readings = list(self.probe.finish().values())
            if readings:
                torch.cat([r.reshape(-1).double() for r in readings]).tolist()


def bookkeeping_seconds(variant: Variant, calls: int = 2000) -> float:
    """CPU seconds per step of the spike check's bookkeeping (no capsule is written: the losses are steady)."""
    output = variant.model(**variant.batch)
    bad = BadSteps(variant.model, StepRecorder(torch.device("cpu")), 3.0, 0, dict)
    start = time.process_time()
    for step in range(calls):
        bad.new_step()
        bad.on_output(output)
        bad.before_optimizer_step(step, 1.0)
    return (time.process_time() - start) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", default="bf16", help="as `mixprec train --precision` (default: bf16)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import tempfile

    with tempfile.TemporaryDirectory() as run_folder:
        variants = [
            Variant("plain", args.precision),
            Variant("stagnation", args.precision, probe=StagnationProbe),
            Variant("precursors", args.precision, probe=PrecursorProbe),
            Variant("hooked", args.precision, PrecisionWatch(every=NEVER), project_dir=run_folder),
            Variant("capsules", args.precision, PrecisionWatch(every=NEVER, spike_factor=3.0), project_dir=run_folder),
            Variant("watch", args.precision, PrecisionWatch(every=1)),
        ]
        for v in variants:
            for _ in range(args.warmup):
                v.step()
        times: dict[str, list[float]] = {v.name: [] for v in variants}
        for r in range(args.rounds):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                start = time.process_time()
                v.step()
                times[v.name].append(time.process_time() - start)
        variants[-1].acc.watch.close()
        direct = bookkeeping_seconds(variants[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(times[k], times["plain"])) for k in times}
    n = DEFAULT_EVERY
    costs = {
        "stagnation": (ratio["stagnation"] - 1) / n,
        "precursors": (ratio["precursors"] - 1) / n,
        "capsules": statistics.median(a / b for a, b in zip(times["capsules"], times["hooked"])) - 1,
        "capsules, timed directly": direct / med["plain"],
        "whole watch": ((n - 1) * ratio["capsules"] + ratio["watch"]) / n - 1,
    }
    print(
        f"watch numerics overhead, GPT small, batch {BATCH} x {SEQ}, {args.precision}, {args.threads} thread(s), "
        f"cpu time, {args.rounds} rounds"
    )
    print(f"  cpu: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    for k in med:
        print(
            f"  {k:10s} step {med[k] * 1e3:8.1f} ms  x{ratio[k]:.3f} plain (median of rounds)  "
            f"(rounds {min(times[k]) * 1e3:.1f}-{max(times[k]) * 1e3:.1f})"
        )
    for k, c in costs.items():
        where = {"capsules": "every step, vs hooked", "capsules, timed directly": f"every step, {direct * 1e6:.0f} us"}
        where = where.get(k, f"at every={n}")
        print(f"  {k:24s} overhead {c * 100:+6.2f}% of step time ({where})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "precision": args.precision,
                    "median_step_s": med,
                    "overhead": costs,
                    "rounds": times,
                    "default_every": n,
                    "argv": sys.argv[1:],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
