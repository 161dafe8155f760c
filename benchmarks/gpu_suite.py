"""GPU section of the suite: GPT-2 124M shape, bf16, torch.compile, MFU against the measured matmul peak.

Runs only where CUDA is present (elsewhere it says so and exits 0). On one GPU, one variant after another
(a dedicated device has no noisy neighbour to interleave against), each from the same seeded initial
weights, with mixprec's step (``mixprec.bench.train_step``: the precision strategy's autocast and its
scaler) and fused AdamW:

- ``fp32``           eager, full fp32 matmuls (TF32 off, torch's default)
- ``bf16``           eager, bf16 autocast
- ``bf16+compile``   bf16 autocast, ``torch.compile(model)`` (compile time reported separately)

Per variant: compile/warm-up seconds, median step time with its interquartile range (CUDA events, one sync
per segment), tokens/s, MFU = flops/token x tokens/s / peak, where flops/token is the model's
``estimate_flops_per_token`` (6N + attention, nanoGPT's formula) and the peak is the best square matmul
of the compute dtype measured at start (``mixprec.bench.measure_peak_flops``), and peak memory
(``max_memory_allocated``: weights, gradients, optimizer state, activations).

Data: the embedded corpus (byte ids, a valid subset of GPT-2's 50257-token vocabulary); nothing is
downloaded. Planned for well under 5 minutes on an H200 (most of it compiling):

    python -m benchmarks.gpu_suite                       # batch 16 x 1024, 20 timed steps per variant
    python -m benchmarks.gpu_suite --json gpu.json
    python -m benchmarks.gpu_suite --variants bf16+compile --steps 50
    python -m benchmarks.gpu_suite --variants bf16+compile,fp8+compile,bf16-pure          # issue 11: fp8
    python -m benchmarks.gpu_suite --model gpt-1b --batch-size 8 --variants bf16+compile,fp8+compile

The fp8 rows train the Linear layers in fp8 through torchao (mixprec's "fp8" precision: layers fp8 cannot take
or that are too small to pay, and the head, stay bf16: precision/fp8_layers.py; ``fp8-all+compile`` converts
every aligned layer, to measure that choice); their MFU is against the bf16 peak, so fp8's speed-up shows as
an MFU above bf16's. ``bf16+compile+chunked``: the GPT with ``vocab_multiple=64`` and ``loss_chunk_size=4096``.

Issue 28's whole GPU run, one command, sections in order under ``--time-limit`` (benchmarks/_gpu_plan.py):

    python -m benchmarks.gpu_suite --plan issue28 --out $OUT --nanogpt nanogpt/ --baseline bf16_before/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from benchmarks._gpu_plan import run_plan


class Variant(NamedTuple):
    """One row: the precision, whether the model is compiled, GPTConfig overrides, and fp8's layer choice."""

    precision: str
    compiled: bool
    model: dict = {}  # noqa: RUF012 (read only)
    fp8_every_layer: bool = False  # fp8 on every aligned layer, the small ones too (fp8_layers.py's skip_small off)


FAST_GPT = {"vocab_multiple": 64, "loss_chunk_size": 4096}  # issue 28: aligned head, no full fp32 logits
VARIANTS = {
    "fp32": Variant("fp32", False),
    "bf16": Variant("bf16", False),
    "bf16+compile": Variant("bf16", True),
    "bf16+compile+chunked": Variant("bf16", True, FAST_GPT),
    # issue 11's GPU rows: fp8 training of the Linear layers (torchao float8; compiled, as torchao advises)
    # and pure bf16; not in the default run: --variants bf16+compile,fp8+compile,bf16-pure
    "fp8": Variant("fp8", False),
    "fp8+compile": Variant("fp8", True),
    "fp8-all+compile": Variant("fp8", True, fp8_every_layer=True),
    "fp8-rowwise+compile": Variant("fp8-rowwise", True),
    "bf16-pure": Variant("bf16-pure", False),
    "bf16-pure+compile": Variant("bf16-pure", True),
}
DEFAULT_VARIANTS = ("fp32", "bf16", "bf16+compile")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the peak each precision's MFU is measured against: fp8 against bf16's (the model's other matmuls are
# bf16, and torch has no portable fp8 matmul to time), so an fp8 MFU above bf16's is the fp8 speed-up
PEAK_OF = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16", "fp8-rowwise": "bf16", "bf16-pure": "bf16"}


@dataclass
class VariantResult:
    variant: str
    precision: str
    compiled: bool
    warmup_s: float
    step_time_s: float
    step_time_iqr_s: float
    tokens_per_s: float
    flops_per_token: float
    peak_flops_per_s: float
    peak_flops_source: str
    mfu: float
    peak_mem_bytes: int | None
    final_loss: float


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: the share of the measured peak the training step achieves."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    return flops_per_token * tokens_per_s / peak_flops_per_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}"
    )
    p.add_argument(
        "--model", default="gpt2", help="built-in GPT preset (default gpt2: the 124M shape), or gpt-1b (0.91B)"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None)
    p.add_argument(
        "--plan",
        choices=["variants", "issue28"],
        default="variants",
        help="variants: the table above (default); issue28: every figure issue 28's goals need (see below)",
    )
    p.add_argument("--out", metavar="DIR", default="gpu_suite_out", help="issue28: where each section's JSON goes")
    p.add_argument("--nanogpt", metavar="PATH", default=None, help="issue28: a nanoGPT checkout (else no comparison)")
    p.add_argument("--baseline", metavar="REV|DIR", default=None, help="issue28: bf16-pure's step before the rewrite")
    p.add_argument("--sections", default=None, help="issue28: a comma-separated subset of the plan's sections")
    p.add_argument("--time-limit", type=float, default=540.0, help="issue28: seconds; later sections are not started")
    # a CPU dry run (tests, and checking the script before a GPU session): same code path, tiny model
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    for name in ("batch_size", "seq_len", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles and allocates)")
    return a


def build_model(name: str, **overrides: object) -> torch.nn.Module:
    """A built-in preset (``GPT.from_preset``: gpt2, gpt-1b, ...) with GPTConfig overrides."""
    from mixprec.models import GPT

    return GPT.from_preset(name, **overrides)


def make_batches(seq_len: int, batch_size: int, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` (input_ids, labels) batches of byte ids from the embedded corpus (on the CPU)."""
    from mixprec.bench import sample_batches
    from mixprec.data import CausalLMDataset, load_corpus

    train, _ = load_corpus().split(0.1)
    return sample_batches(CausalLMDataset(train, seq_len), batch_size, count, seed=seed)


def run_variant(name: str, a: argparse.Namespace, batches: list, peaks: dict) -> VariantResult:
    from mixprec.bench import make_timer, summarize, train_step
    from mixprec.precision import resolve_precision

    variant = VARIANTS[name]
    precision_name, compiled = variant.precision, variant.compiled
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(a.seed)
    model = build_model(a.model, **variant.model).to(device).train()
    with torch.device("meta"):  # useful flops: the unpadded model's, the same for every variant
        flops_per_token = float(build_model(a.model).estimate_flops_per_token(a.seq_len))
    precision = resolve_precision(precision_name, device)
    if variant.fp8_every_layer:
        from mixprec.precision.fp8_layers import Fp8LayerFilter

        precision.layer_filter = Fp8LayerFilter(precision.recipe, skip_small=False)
    model = precision.convert_module(model)  # fp8: Linear layers to torchao's; bf16-pure: the weights to bf16
    optimizer = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True))
    scaler = precision.make_scaler()
    runnable = torch.compile(model) if compiled else model
    on_device = [{k: v.to(device) for k, v in b.items()} for b in batches]

    t0 = time.perf_counter()
    for i in range(a.warmup):
        train_step(runnable, on_device[i % len(on_device)], precision, optimizer, scaler)
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0

    timer = make_timer(device)  # CUDA events on a GPU
    losses = []
    for i in range(a.steps):
        timer.start()
        losses.append(train_step(runnable, on_device[(a.warmup + i) % len(on_device)], precision, optimizer, scaler))
        timer.stop()
    times = timer.times()  # the one sync of the timed segment
    summary = summarize(times)
    peak_mem = torch.cuda.max_memory_allocated() - baseline if cuda else None
    tokens_per_s = a.batch_size * a.seq_len / summary.median
    peak = peaks[PEAK_OF[precision_name]]
    result = VariantResult(
        variant=name,
        precision=precision_name,
        compiled=compiled,
        warmup_s=warmup_s,
        step_time_s=summary.median,
        step_time_iqr_s=summary.spread,
        tokens_per_s=tokens_per_s,
        flops_per_token=flops_per_token,
        peak_flops_per_s=peak.flops_per_s,
        peak_flops_source=peak.source,
        mfu=mfu(flops_per_token, tokens_per_s, peak.flops_per_s),
        peak_mem_bytes=peak_mem,
        final_loss=float(torch.stack(losses[-5:]).float().mean()),
    )
    del model, runnable, optimizer, scaler, on_device
    if cuda:
        torch.cuda.empty_cache()
    return result


def format_report(results: list[VariantResult], header: str) -> str:
    cols = ["variant", "warm-up", "step (median)", "IQR", "tokens/s", "MFU", "peak mem", "loss (last 5)"]
    rows = [
        [
            r.variant,
            f"{r.warmup_s:.1f} s",
            f"{r.step_time_s * 1e3:.1f} ms",
            f"{r.step_time_iqr_s * 1e3:.2f} ms",
            f"{r.tokens_per_s:,.0f}",
            f"{r.mfu * 100:.1f}%",
            "-" if r.peak_mem_bytes is None else f"{r.peak_mem_bytes / 2**30:.2f} GiB",
            f"{r.final_loss:.3f}",
        ]
        for r in results
    ]
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [header, "", fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    lines += ["", *sorted({f"peak ({r.precision}): {r.peak_flops_source}" for r in results})]
    base = next((r for r in results if r.variant == "fp32"), None)
    for r in results:
        if base is not None and r is not base:
            lines.append(f"{r.variant}: {base.step_time_s / r.step_time_s:.2f}x the speed of fp32")
    return "\n".join(lines)


def run_variants(a: argparse.Namespace) -> tuple[list[VariantResult], str]:
    """Every variant of ``a.variants`` on ``a.model``, one after another; the results and the table's header."""
    from mixprec.bench import measure_peak_flops

    started = time.perf_counter()
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print(f"[gpu_suite] {name}, torch {torch.__version__}, CUDA {torch.version.cuda}", file=sys.stderr, flush=True)
    needed = sorted({PEAK_OF[VARIANTS[v].precision] for v in a.variants})
    peaks = {p: measure_peak_flops(DTYPES[p], a.device, repeats=10) for p in needed}
    for p, peak in peaks.items():
        print(f"[gpu_suite] peak {p}: {peak.source}", file=sys.stderr, flush=True)
    batches = make_batches(a.seq_len, a.batch_size, min(a.warmup + a.steps, 16), a.seed)
    results = []
    for v in a.variants:
        if getattr(a, "deadline", None) is not None and time.perf_counter() > a.deadline:
            print(f"[gpu_suite] {v}: not run (the time limit was reached)", file=sys.stderr, flush=True)
            continue
        print(f"[gpu_suite] running {v}", file=sys.stderr, flush=True)
        results.append(run_variant(v, a, batches, peaks))
        r = results[-1]
        print(f"[gpu_suite] {v}: {r.step_time_s * 1e3:.1f} ms/step, MFU {r.mfu:.1%}", file=sys.stderr, flush=True)
        if VARIANTS[v].compiled:
            torch._dynamo.reset()  # the compiled graphs of one variant hold no memory into the next
    header = (
        f"gpu_suite: GPT {a.model!r} (batch {a.batch_size} x {a.seq_len}), fused AdamW, {a.warmup} warm-up + "
        f"{a.steps} timed steps per variant; {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); took "
        f"{time.perf_counter() - started:.0f} s"
    )
    return results, header


def variants_table(a: argparse.Namespace) -> dict:
    """:func:`run_variants`, its table printed; {"header", "rows"} (the issue-28 plan's gpt2 sections)."""
    results, header = run_variants(a)
    print(format_report(results, header), flush=True)
    return {"header": header, "rows": [asdict(r) for r in results]}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_suite: skipped: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"skipped": "no CUDA device"}, f)
        return 0
    if a.plan == "issue28":
        return run_plan(a, variants_table)
    results, header = run_variants(a)
    print(format_report(results, header))
    if a.json:
        name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
        doc = {"header": header, "device": name, "argv": sys.argv[1:], "results": [asdict(r) for r in results]}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
