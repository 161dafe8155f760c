"""The bare training step: nanoGPT's model.py against mixprec's GPT, each precision, no loop around it (issue 36).

    python -m benchmarks.bench_bare_step --nanogpt ~/nanoGPT                    # the main job's shape, 2 threads
    python -m benchmarks.bench_bare_step --nanogpt ~/nanoGPT --rounds 7 --steps 10 --json bare.json
    python -m benchmarks.bench_bare_step                                        # mixprec's GPT only
    python -m benchmarks.bench_bare_step --nanogpt ~/nanoGPT --device cuda --model gpt2 --batch-size 12 \
        --seq-len 1024 --compile                                                # nanoGPT's GPT-2 step on a GPU

Why: ``benchmarks.vs_nanogpt`` and ``benchmarks.bench_main_job`` time whole runs, so a gap there is either the
step (the model's own ops under the precision) or the loop around it (evaluations, data, logging, the race).
This times only the step, the same for every variant: forward with the loss, backward, clip the gradient
norm to 1.0, fused AdamW step (torch's CPU kernel where it has one), zero the gradients; the same batch of
random tokens every step, so no data loading either. What varies is the model (nanoGPT's ``GPT`` from the
checkout's ``model.py``, imported by path, nothing copied; or mixprec's) and the precision: ``fp32``, ``bf16``
(plain autocast) and ``bf16:fp32_ops=attention`` (mixprec's op policy, which works on any model: it sees
``F.scaled_dot_product_attention`` whoever calls it). Both models take the preset's shape with biases on and
no dropout, and the same initial weights where their parameter names agree (mixprec's GPT is nanoGPT's
layout).

Per round every variant runs ``--steps`` steps after its warm-up steps, in an order that alternates each
round; the figure is each variant's median ms per step over rounds, with its interquartile range, and two
ratios: against the same model's fp32 (what the precision buys in the bare step) and against nanoGPT's fp32
(what ``vs_nanogpt`` could show at best, were the loop free). A whole run realising less than these ratios
is losing it in the loop; a run realising them and still short of a goal is short in the step.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mixprec.models import GPT, GPT_PRESETS, GPTConfig
from mixprec.precision import make_precision

PRECISIONS = ("fp32", "bf16", "bf16:fp32_ops=attention")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, default=None, help="a checkout of karpathy/nanoGPT (omit: mixprec only)")
    p.add_argument("--model", default="small", choices=sorted(GPT_PRESETS))
    p.add_argument("--batch-size", type=int, default=16, help="the main job's (16)")
    p.add_argument("--seq-len", type=int, default=128, help="the main job's (128)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated mixprec precision names")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before the first round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--compile", action="store_true", help="torch.compile each model (nanoGPT's default on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "threads", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        p.error(f"--nanogpt {args.nanogpt} has no model.py: pass a checkout of karpathy/nanoGPT")
    return args


def load_nanogpt(checkout: Path):
    """nanoGPT's ``model`` module from ``checkout/model.py``, imported by path under a private name."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """Each tool's model at the preset's shape, biases on, no dropout, from the same initial weights."""
    preset = GPT_PRESETS[args.model]
    shape = dict(vocab_size=preset.vocab_size, block_size=preset.block_size, n_layer=preset.n_layer)
    shape.update(n_head=preset.n_head, n_embd=preset.n_embd, dropout=0.0, bias=True)
    torch.manual_seed(args.seed)
    models: dict[str, torch.nn.Module] = {"mixprec": GPT(GPTConfig(**shape))}
    if args.nanogpt is not None:
        nano = load_nanogpt(args.nanogpt)
        theirs = nano.GPT(nano.GPTConfig(**shape))
        ours = models["mixprec"].state_dict()
        shared = {k: v for k, v in ours.items() if k in theirs.state_dict()}
        theirs.load_state_dict(shared, strict=False)
        models["nanogpt"] = theirs
    return models


def make_step(
    tool: str, model: torch.nn.Module, precision_name: str, batch: torch.Tensor, compiled: bool = False
) -> Callable[[], None]:
    """One training step of ``model`` (on ``batch``'s device) under ``precision_name``: forward with the loss,
    backward, clip, fused AdamW (torch has the kernel on CPU and CUDA)."""
    device = batch.device
    model.to(device)
    precision = make_precision(precision_name, device.type)
    precision.bind(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    forward = torch.compile(model) if compiled else model

    def loss() -> torch.Tensor:
        if tool == "nanogpt":
            return forward(inputs, targets)[1]
        # the main job's windows: T tokens in, the loss over T - 1 positions (mixprec shifts inside)
        return forward(input_ids=inputs, labels=inputs).loss

    def step() -> None:
        with precision.autocast():
            value = loss()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_steps(step: Callable[[], None], n: int, device: torch.device) -> float:
    """Mean ms per step over ``n`` steps (a GPU's queue drained before and after)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - start) * 1e3 / n


def main(argv: list[str] | None = None) -> dict[str, dict[str, float | None]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    models = build_models(args)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = GPT_PRESETS[args.model].vocab_size
    batch = torch.randint(vocab, (args.batch_size, args.seq_len + 1), generator=generator).to(args.device)
    variants: dict[str, Callable[[], None]] = {}
    for tool, model in models.items():
        for name in args.precisions.split(","):
            # every variant trains its own copy from the same start (an optimizer per copy)
            variants[f"{tool} {name}"] = make_step(tool, copy.deepcopy(model), name, batch, args.compile)
    for step in variants.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {key: [] for key in variants}
    order = list(variants)
    for r in range(args.rounds):
        for key in order if r % 2 == 0 else reversed(order):
            times[key].append(time_steps(variants[key], args.steps, batch.device))
    return report(args, times)


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    def median(key: str) -> float:
        return statistics.median(times[key])

    print(
        f"bare step: {args.model}, batch {args.batch_size} x {args.seq_len}, {args.device}"
        f"{', compiled' if args.compile else ''}, {args.threads} threads, "
        f"{args.rounds} rounds of {args.steps} steps (torch {torch.__version__})"
    )
    print(f"{'variant':36s} {'ms/step':>9s} {'IQR':>13s} {'vs own fp32':>12s} {'vs nanoGPT fp32':>16s}")
    figures: dict[str, dict[str, float | None]] = {}
    for key, values in times.items():
        tool = key.split(" ")[0]
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        row: dict[str, float | None] = {"ms_per_step": median(key), "q1": q[0], "q3": q[2]}
        row["vs_own_fp32"] = median(f"{tool} fp32") / median(key) if f"{tool} fp32" in times else None
        row["vs_nanogpt_fp32"] = median("nanogpt fp32") / median(key) if "nanogpt fp32" in times else None
        figures[key] = row
        ratios = " ".join(
            f"{'-' if r is None else f'{r:.2f}x':>{w}s}"
            for r, w in ((row["vs_own_fp32"], 12), (row["vs_nanogpt_fp32"], 16))
        )
        print(f"{key:36s} {median(key):9.2f} {q[0]:6.2f}-{q[2]:6.2f} {ratios}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"args": {**vars(args), "nanogpt": str(args.nanogpt), "json": None}, "figures": figures}, indent=2
            )
        )
    return figures


if __name__ == "__main__":
    main()
