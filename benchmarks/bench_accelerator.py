"""Overhead of the Accelerator loop over the hand-written torch.amp loop, and HF Accelerate on the same work.

    python benchmarks/bench_accelerator.py                 # fp16, bf16 and fp32 on the CPU, ~1-2 minutes
    python benchmarks/bench_accelerator.py --precisions fp16 --rounds 30 --json out.json

Variants, each training its own copy of the same model on the same batches:

- ``torch``: the seed's first snippet: ``torch.autocast`` + ``torch.amp.GradScaler("cpu")`` (device given:
  the default device is CUDA, and the scaler quietly disables itself on a CPU-only machine);
- ``mixprec``: the seed's second snippet with ``mixprec.Accelerator`` (prepared model and optimizer);
- ``hf``: the same loop with ``accelerate.Accelerator`` (when installed). What it really ran is reported:
  the dtype its inner Linear layers produced and whether it scaled the loss.

Method: warm-up, then interleaved rounds (the variants' order rotates every round, so a noisy neighbour
hurts them alike); each round times ``--steps`` steps of each variant. Reported: the median time per step
and its spread (25th-75th percentile), and the median over rounds of the per-round ratio to ``torch`` (a
paired comparison in the same round). Goal: mixprec / torch <= 1.02.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec import Accelerator

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Output:
    """What an HF model returns, reduced to what the loop reads."""

    loss: torch.Tensor
    logits: torch.Tensor


class Model(torch.nn.Module):
    """Embedding, a 2-layer MLP block with a residual and LayerNorm, and a head: GEMMs dominate a step."""

    def __init__(self, vocab: int = 64, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        h = self.embed(input_ids)
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        logits = self.head(h)
        return Output(F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits)


def make_batches(n: int, batch: int, seq: int, vocab: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((ids, (ids + 1) % vocab))
    return out


Step = Callable[[torch.Tensor, torch.Tensor], None]


def torch_loop(model: Model, precision: str) -> tuple[Step, dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with torch.autocast(device_type="cpu", dtype=dtype, enabled=precision != "fp32"):
            outputs = model(inputs, labels=targets)
            loss = outputs.loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return step, {"loss_scaling": scaler.is_enabled()}


def mixprec_loop(model: Model, precision: str) -> tuple[Step, dict]:
    accelerator = Accelerator(mixed_precision=precision, verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs = model(inputs, labels=targets)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step, {"loss_scaling": accelerator.scaler.is_enabled()}


def hf_loop(model: Model, precision: str) -> tuple[Step, dict]:
    from accelerate import Accelerator as HFAccelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # one HF Accelerator per process otherwise
    GradientState._reset_state()
    accelerator = HFAccelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs = model(inputs, labels=targets)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step, {"loss_scaling": accelerator.scaler is not None}


def linear_dtype(model: torch.nn.Module, step: Step, batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    """The dtype an inner Linear layer really produced (outputs may be cast back to fp32 afterwards)."""
    seen: list[torch.dtype] = []
    handle = model.up.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    step(*batch)
    handle.remove()
    return str(seen[0]).removeprefix("torch.")


def bench_precision(precision: str, args: argparse.Namespace, hf: bool) -> dict:
    torch.manual_seed(0)
    base = Model()
    batches = make_batches(args.steps, args.batch, args.seq)
    builders = {"torch": torch_loop, "mixprec": mixprec_loop}
    if hf:
        builders["hf"] = hf_loop
    variants, info = {}, {}
    for name, build in builders.items():
        model = copy.deepcopy(base)
        step, meta = build(model, precision)
        meta["linear_dtype"] = linear_dtype(model, step, batches[0])
        for batch in batches[: args.warmup]:
            step(*batch)
        variants[name], info[name] = step, meta
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            step = variants[name]
            t0 = time.perf_counter()
            for batch in batches:
                step(*batch)
            times[name].append((time.perf_counter() - t0) / len(batches))
    result = {"precision": precision, "variants": {}}
    for name in names:
        ts = sorted(times[name])
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
        ratios = [t / b for t, b in zip(times[name], times["torch"])]
        result["variants"][name] = {
            **info[name],
            "ms_per_step": statistics.median(ts) * 1e3,
            "ms_p25": q[0] * 1e3,
            "ms_p75": q[2] * 1e3,
            "ratio_to_torch": statistics.median(ratios),
            "ratio_p25": statistics.quantiles(ratios, n=4)[0] if len(ratios) >= 2 else ratios[0],
            "ratio_p75": statistics.quantiles(ratios, n=4)[2] if len(ratios) >= 2 else ratios[0],
        }
    return result


def report(results: list[dict]) -> str:
    lines = [
        f"{'precision':<9} {'variant':<8} {'ms/step':>8} {'p25-p75':>15} {'x torch':>8} {'(p25-p75)':>13}  "
        "matmuls   loss scaling"
    ]
    for res in results:
        for name, v in res["variants"].items():
            spread = f"{v['ms_p25']:.3f}-{v['ms_p75']:.3f}"
            ratio = f"{v['ratio_p25']:.3f}-{v['ratio_p75']:.3f}"
            scaling = "on" if v["loss_scaling"] else "off"
            lines.append(
                f"{res['precision']:<9} {name:<8} {v['ms_per_step']:>8.3f} {spread:>15} "
                f"{v['ratio_to_torch']:>8.3f} {ratio:>13}  {v['linear_dtype']:<9} {scaling}"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", nargs="+", default=["fp16", "bf16", "fp32"], choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)")
    p.add_argument("--no-hf", action="store_true", help="skip HF Accelerate")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import accelerate  # noqa: F401

        hf = not args.no_hf
    except ImportError:
        hf = False
    start = time.perf_counter()
    results = [bench_precision(precision, args, hf) for precision in args.precisions]
    print(report(results))
    print(
        f"\n{args.rounds} interleaved rounds x {args.steps} steps, batch {args.batch}x{args.seq}, "
        f"{args.threads} thread(s), torch {torch.__version__}, {time.perf_counter() - start:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
