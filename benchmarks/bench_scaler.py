"""mixprec.GradScaler vs torch.amp.GradScaler("cpu") on the same fp16 CPU training step.

Both scalers drive identical copies of a small transformer-ish MLP block (Linear, GELU, Linear, LayerNorm,
head) under fp16 autocast. After a warm-up, the variants run in interleaved rounds (the order alternates
each round) so a noisy neighbour hurts both alike; each round times a block of steps. The report gives, per
variant, the median over rounds of the mean step time and the range of those round means, then the median
over rounds of the paired ratio mixprec / torch (goal: <= 1.02) and the ratio of the medians. It does so for
the whole step and for the scaler's part of it alone (scale + step, which runs the optimizer, + update),
with the foreach (default) and the fused AdamW. Both variants must end with bit-identical parameters: the
same step, really. Time is this process's CPU time with one torch thread unless asked otherwise (see --help).

    python -m benchmarks.bench_scaler                 # 20-50 s on the shared 2-core dev box
    python -m benchmarks.bench_scaler --rounds 5      # a quick look
    python -m benchmarks.bench_scaler --json out.json # also write the figures
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mixprec

WIDTH, HIDDEN, CLASSES, BATCH = 64, 128, 16, 32
# CPU time of this process by default: on a shared box, wall time mostly measures waiting for a core (the
# load average of the 2-core dev box is often 4-7), while with one torch thread CPU time is the work done.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
CLOCK = CLOCKS["cpu"]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, WIDTH),
        torch.nn.LayerNorm(WIDTH),
        torch.nn.Linear(WIDTH, CLASSES),
    )


class Variant:
    """One scaler driving its own copy of the model. ``path`` accumulates the time spent in the scaler's
    part of the step (scale, step (which runs the optimizer), update): the same optimizer work for both
    scalers, without the forward/backward whose noise swamps small differences."""

    def __init__(self, scaler, fused: bool) -> None:
        self.scaler, self.model = scaler, make_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=fused)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
        self.path = 0.0

    def step(self) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(self.model(self.x), self.y)
        t0 = CLOCK()
        scaled = self.scaler.scale(loss)
        t1 = CLOCK()
        scaled.backward()
        t2 = CLOCK()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.path += CLOCK() - t2 + (t1 - t0)
        self.opt.zero_grad(set_to_none=True)

    def block(self, steps: int) -> tuple[float, float]:
        """Mean seconds per whole step and per scaler path over ``steps`` steps."""
        self.path = 0.0
        t0 = CLOCK()
        for _ in range(steps):
            self.step()
        return (CLOCK() - t0) / steps, self.path / steps


def _summary(samples: dict[str, list[float]], scale: float) -> dict[str, object]:
    ratios = [m / t for m, t in zip(samples["mixprec"], samples["torch"])]
    return {
        "median": {n: scale * statistics.median(s) for n, s in samples.items()},
        "spread": {n: [scale * min(s), scale * max(s)] for n, s in samples.items()},
        "ratio_of_medians": statistics.median(samples["mixprec"]) / statistics.median(samples["torch"]),
        "median_paired_ratio": statistics.median(ratios),
        "paired_ratio_spread": [min(ratios), max(ratios)],
    }


def compare(fused: bool, rounds: int, steps: int, warmup: int) -> dict[str, object]:
    variants = {"torch": Variant(torch.amp.GradScaler("cpu"), fused), "mixprec": Variant(mixprec.GradScaler(), fused)}
    for v in variants.values():
        for _ in range(warmup):
            v.step()
    whole: dict[str, list[float]] = {name: [] for name in variants}
    path: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            w, p = variants[name].block(steps)
            whole[name].append(w)
            path[name].append(p)
    for a, b in zip(variants["torch"].model.parameters(), variants["mixprec"].model.parameters()):
        if not torch.equal(a, b):
            raise AssertionError("the two scalers diverged: the benchmark is not comparing the same step")
    return {
        "optimizer": "AdamW(fused=True)" if fused else "AdamW (foreach)",
        "step_ms": _summary(whole, 1e3),
        "scaler_path_us": _summary(path, 1e6),
    }


def _print(title: str, res: dict[str, object], unit: str) -> None:
    med, spread = res["median"], res["spread"]
    print(f"  {title}")
    for name in ("torch", "mixprec"):
        lo, hi = spread[name]
        print(f"    {name:8s} median {med[name]:9.3f} {unit}   rounds {lo:9.3f} .. {hi:9.3f}")
    lo, hi = res["paired_ratio_spread"]
    print(
        f"    mixprec/torch: median paired ratio {res['median_paired_ratio']:.3f} (rounds {lo:.3f} .. {hi:.3f}); "
        f"ratio of medians {res['ratio_of_medians']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    parser.add_argument("--steps", type=int, default=20, help="training steps timed per round (default 20)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first (default 10)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core box a second thread mostly measures the neighbours)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (default; robust to neighbours with --threads 1); wall: elapsed time",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = CLOCKS[args.clock]

    print(
        f"torch {torch.__version__}, mixprec {mixprec.__version__}, python {platform.python_version()}, "
        f"{torch.get_num_threads()} thread(s), {args.clock} clock; fp16 autocast step of a "
        f"{WIDTH}-{HIDDEN}-{WIDTH}-{CLASSES} MLP block, batch {BATCH}; "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up"
    )
    results = []
    for fused in (False, True):
        res = compare(fused, args.rounds, args.steps, args.warmup)
        results.append(res)
        print(f"\n{res['optimizer']}")
        _print("whole training step (goal: ratio <= 1.02)", res["step_ms"], "ms")
        _print("scaler path only: scale + step (with the optimizer) + update", res["scaler_path_us"], "us")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"threads": torch.get_num_threads(), "clock": args.clock, "torch": torch.__version__}
            json.dump({**meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
