"""Memory-lean modes on the 25M-parameter built-in GPT: step time, peak memory, bytes per parameter; and fp8's loss.

    python -m benchmarks.bench_lean                        # ~6 min on the 2-core dev box (1 thread)
    python -m benchmarks.bench_lean --rounds 3 --json lean.json
    python -m benchmarks.bench_lean --only memory          # or: speed, fp8
    python -m benchmarks.bench_lean --only parity          # ~15 min: bf16-pure's loss against bf16 autocast

Part 1, the lean modes (``MODES``: a mode name -> a builder; add a row by adding an entry). Each builds the
same initial model (GPT, 8 layers x 512, 25.4M parameters, bytes as tokens) through the library's own path:
``resolve_precision`` -> ``convert_module``, ``build_optimizer`` from ``TrainingArguments(optim=...)`` ->
``convert_optimizer``, and trains it on the same batches (8 x 128 tokens) with the precision's own
``backward`` / ``optimizer_step``.

- bytes / param: parameters + gradients + optimizer state, counted from the tensors after a step
  (:func:`mixprec.bench.footprint.training_state_bytes`; torchao's quantised states by their inner tensors).
- peak memory: growth of the process's peak RSS while building the model and its optimizer and running 2
  steps, from a trimmed heap (:func:`mixprec.bench.memory.measure_run`): what the OS had to give the mode.
- step time (measured first, so that the memory figures exclude every first-use cost): after warm-up
  (torchao's 8/4-bit optimizers compile their step on first use), interleaved rounds (the order rotates each
  round), one step per mode per round; median and interquartile range, the optimizer step alone too, and
  the ratio of medians to the first mode.

Part 2, fp8 (emulated: MIXPREC_FP8_EMULATE=1, a CPU has no fp8 matmuls): the default ``mixprec train`` model
("small" preset, 0.8M parameters) trained for ``--fp8-steps`` steps on the embedded corpus under bf16, fp8
and fp8-rowwise from the same initial weights and batches; the mean training loss of the last 10 steps and a
held-out loss, as ratios to bf16's. This measures numerics only: emulated fp8 is slower than bf16.

Part 3, parity (only with ``--only parity``): the 25M GPT trained ``--parity-steps`` steps under bf16 autocast
(fp32 master weights and AdamW states), bf16-pure (stochastic rounding) and bf16-pure-kahan from the same
initial weights and batches; the held-out loss at four evenly spaced points, as ratios to bf16 autocast's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.accelerator.step_in_backward import BackwardStepper
from mixprec.bench.footprint import training_state_bytes
from mixprec.bench.memory import measure_run
from mixprec.data.corpus import stdlib_corpus
from mixprec.models import GPT, GPT_PRESETS, GPTConfig
from mixprec.precision import Precision, resolve_precision
from mixprec.trainer.args import TrainingArguments
from mixprec.trainer.optimizers import build_optimizer

GPT_25M = GPTConfig(block_size=128, n_layer=8, n_head=8, n_embd=512)  # 25.4M parameters
BATCH, SEQ = 8, 128
LR = 3e-4


@dataclass
class Mode:
    """A model ready to train in one mode: the converted model, its optimizer and the precision strategy."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    stepper: BackwardStepper | None = None
    """step_in_backward: hooks that update each parameter during backward (then the step has nothing to do)."""


Builder = Callable[[Callable[[], torch.nn.Module]], Mode]


def library_mode(
    precision: str, optim: str = "adamw_torch", optim_args: str | None = None, step_in_backward: bool = False
) -> Builder:
    """A builder going through the library's own path, as the Trainer does."""

    def build(fresh_model: Callable[[], torch.nn.Module]) -> Mode:
        p = resolve_precision(precision, "cpu")
        model = p.convert_module(fresh_model())
        args = TrainingArguments(output_dir="unused", optim=optim, optim_args=optim_args, learning_rate=LR)
        optimizer = p.convert_optimizer(build_optimizer(model, args.optimization))
        return Mode(model, optimizer, p, BackwardStepper(optimizer, p) if step_in_backward else None)

    return build


# The rows of part 1, first one the reference of the ratios. Add a mode by adding an entry.
MODES: dict[str, Builder] = {
    "fp32 + AdamW": library_mode("fp32"),
    "bf16 autocast + AdamW": library_mode("bf16"),
    "bf16 autocast + adamw_torch_8bit": library_mode("bf16", "adamw_torch_8bit"),
    "bf16 autocast + adamw_torch_4bit": library_mode("bf16", "adamw_torch_4bit"),
    "bf16 autocast + adamw_anyprecision (bf16 moments)": library_mode(
        "bf16", "adamw_anyprecision", "momentum_dtype=bfloat16,variance_dtype=bfloat16"
    ),
    "bf16-pure + AdamW (stochastic rounding)": library_mode("bf16-pure"),
    "bf16-pure-kahan + AdamW (Kahan summation)": library_mode("bf16-pure-kahan"),
    "bf16-pure + adamw_torch_8bit (torchao's stochastic rounding)": library_mode("bf16-pure", "adamw_torch_8bit"),
    "bf16-pure + adamw_torch_8bit, block_size=2048 (bitsandbytes' block)": library_mode(
        "bf16-pure", "adamw_torch_8bit", "block_size=2048"
    ),
    "bf16-pure + AdamW, step in backward": library_mode("bf16-pure", step_in_backward=True),
    "bf16-pure + adamw_torch_8bit, step in backward": library_mode(
        "bf16-pure", "adamw_torch_8bit", step_in_backward=True
    ),
}


def train_step(mode: Mode, batch: torch.Tensor) -> tuple[float, float]:
    """One step through the precision's hooks; returns (whole step, optimizer step) seconds."""
    t0 = time.perf_counter()
    with mode.precision.autocast():
        loss = mode.model(batch, labels=batch).loss
    mode.precision.backward(loss)
    t1 = time.perf_counter()
    if mode.stepper is None:
        mode.precision.optimizer_step(mode.optimizer)
    else:  # every parameter was updated during backward
        mode.precision.end_step()
    mode.optimizer.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def batches(n: int, seq: int, seed: int = 0, split: str = "train") -> list[torch.Tensor]:
    train, val = stdlib_corpus().split()
    data = (train if split == "train" else val).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq, (n, BATCH), generator=g)
    return [torch.stack([data[s : s + seq] for s in row.tolist()]) for row in starts]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


# -- part 1 ---------------------------------------------------------------------------------------------


def lean_modes(a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    initial = GPT(GPT_25M).state_dict()
    n_params = sum(p.numel() for p in GPT(GPT_25M).parameters())  # the tied head counted once

    def fresh() -> torch.nn.Module:
        model = GPT(GPT_25M)
        model.load_state_dict(initial)
        return model.train()

    data = batches(4, SEQ)
    chosen = {
        name: b for i, (name, b) in enumerate(MODES.items()) if i == 0 or not a.modes or any(t in name for t in a.modes)
    }
    out: dict[str, Any] = {"params": n_params, "modes": {name: {} for name in chosen}}
    if a.only in (None, "speed"):  # first, so that memory is measured after every first-use cost
        modes = {name: builder(fresh) for name, builder in chosen.items()}
        for name, mode in modes.items():  # warm-up: first-use costs (torchao compiles its step here)
            t = time.perf_counter()
            for b in data[: a.warmup]:
                train_step(mode, b)
            out["modes"][name]["warmup_s"] = time.perf_counter() - t
            print(f"  warmed up {name} in {out['modes'][name]['warmup_s']:.1f}s", flush=True)
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in modes}
        names = list(modes)
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                times[name].append(train_step(modes[name], data[r % len(data)]))
            print(f"  round {r + 1}/{a.rounds}", flush=True)
        for name, ts in times.items():
            out["modes"][name]["step_s"] = quartiles([t for t, _ in ts])
            out["modes"][name]["optimizer_s"] = quartiles([o for _, o in ts])
        del modes
    if a.only in (None, "memory"):
        for name, builder in chosen.items():
            row = out["modes"][name]

            def prepare(builder: Builder = builder, row: dict[str, Any] = row) -> Callable[[], None]:
                def run() -> None:
                    mode = builder(fresh)
                    for b in data[:2]:
                        train_step(mode, b)
                    row["bytes"] = training_state_bytes(mode.model, mode.optimizer, mode.stepper is not None)
                    row["reason"] = mode.precision.describe()["reason"]

                return run

            m = measure_run(prepare, "cpu")
            row["peak_bytes"] = m.peak_bytes if m else None
            print(f"  measured the memory of {name}", flush=True)
    return out


# -- part 2 ---------------------------------------------------------------------------------------------


def train_losses(config: GPTConfig, names: tuple[str, ...], steps: int, evals: int = 1) -> dict[str, Any]:
    """Train ``config`` under each precision in ``names`` from the same initial weights on the same batches;
    per mode the first and the mean of the last 10 training losses, and the held-out loss (8 batches of the
    validation split) at ``evals`` evenly spaced points, the last one after the final step."""
    torch.manual_seed(0)
    initial = GPT(config).state_dict()
    train, held_out = batches(steps, SEQ, seed=1), batches(8, SEQ, seed=2, split="val")
    at = {round(steps * (i + 1) / evals) for i in range(evals)}
    out: dict[str, Any] = {}
    for name in names:
        t = time.perf_counter()

        def fresh() -> torch.nn.Module:
            model = GPT(config)
            model.load_state_dict(initial)
            return model.train()

        mode = library_mode(name)(fresh)
        losses, held = [], {}
        for step, b in enumerate(train, 1):
            with mode.precision.autocast():
                loss = mode.model(b, labels=b).loss
            mode.precision.backward(loss)
            mode.precision.optimizer_step(mode.optimizer)
            mode.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step in at:
                mode.model.eval()
                with torch.no_grad(), mode.precision.autocast():
                    held[step] = statistics.mean(mode.model(b, labels=b).loss.item() for b in held_out)
                mode.model.train()
        out[name] = {
            "train_last10": statistics.mean(losses[-10:]),
            "first": losses[0],
            "held_out": held[steps],
            "held_out_at": held,
            "seconds": time.perf_counter() - t,
            "reason": mode.precision.describe()["reason"],
        }
        curve = ", ".join(f"{k}: {v:.4f}" for k, v in held.items())
        print(f"  {name}: train {out[name]['train_last10']:.4f}; held out {curve}", flush=True)
    return out


def fp8_losses(a: argparse.Namespace) -> dict[str, Any]:
    os.environ["MIXPREC_FP8_EMULATE"] = "1"  # test-only emulation: a CPU has no fp8 matmuls
    return train_losses(GPT_PRESETS["small"], ("bf16", "fp8", "fp8-rowwise"), a.fp8_steps)


def parity_losses(a: argparse.Namespace) -> dict[str, Any]:
    """bf16-pure (both compensations) against bf16 autocast with fp32 master weights, on the 25M GPT."""
    return train_losses(GPT_25M, ("bf16", "bf16-pure", "bf16-pure-kahan"), a.parity_steps, evals=4)


# -- report ---------------------------------------------------------------------------------------------


def report(lean: dict[str, Any] | None, fp8: dict[str, Any] | None, parity: dict[str, Any] | None = None) -> str:
    lines = []
    if lean:
        lines += [
            f"GPT {GPT_25M.n_layer}x{GPT_25M.n_embd}, {lean['params'] / 1e6:.1f}M parameters, batch {BATCH} x {SEQ}",
            "",
            "| mode | bytes/param (params + grads + states) | peak memory growth | step median (IQR) | "
            "optimizer step | step vs first |",
            "|---|---|---|---|---|---|",
        ]
        ref = next(iter(lean["modes"].values())).get("step_s")
        for name, row in lean["modes"].items():
            b = row.get("bytes")
            bpp = "-"
            if b:  # measured by the memory part only
                n = lean["params"]
                bpp = f"{b['per_param']:.2f} ({b['params'] / n:.1f} + {b['grads'] / n:.1f} + {b['optimizer'] / n:.2f})"
            peak = f"{row['peak_bytes'] / 2**20:.0f} MiB" if row.get("peak_bytes") is not None else "-"
            if "step_s" in row:
                lo, med, hi = row["step_s"]
                step = f"{med * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})"
                opt = f"{row['optimizer_s'][1] * 1e3:.0f} ms"
                ratio = f"{med / ref[1]:.2f}x" if ref else "-"
            else:
                step = opt = ratio = "-"
            lines.append(f"| {name} | {bpp} | {peak} | {step} | {opt} | {ratio} |")
    for title, table in (("small GPT, emulated fp8", fp8), (f"GPT {GPT_25M.n_layer}x{GPT_25M.n_embd}", parity)):
        if not table:
            continue
        ref = table["bf16"]
        lines += [
            "",
            f"| {title} | first loss | train loss (last 10) | vs bf16 | held-out loss | vs bf16 |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in table.items():
            lines.append(
                f"| {name} | {r['first']:.4f} | {r['train_last10']:.4f} "
                f"| {r['train_last10'] / ref['train_last10']:.4f} "
                f"| {r['held_out']:.4f} | {r['held_out'] / ref['held_out']:.4f} |"
            )
        if len(ref["held_out_at"]) > 1:
            base = ref["held_out_at"]
            gaps = [r["held_out_at"][k] / base[k] - 1 for r in table.values() if r is not ref for k in base]
            lines.append(
                f"held-out loss against bf16's at every evaluation: at most {max(gaps) * 100:+.2f}% "
                f"(worse), at least {min(gaps) * 100:+.2f}% (better)"
            )
    if fp8:
        lines.append(f"fp8 reason: {fp8['fp8']['reason']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per mode (default 2)")
    parser.add_argument("--fp8-steps", type=int, default=150, help="training steps per mode in part 2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared box)")
    parser.add_argument("--parity-steps", type=int, default=300, help="training steps per mode in part 3")
    parser.add_argument("--only", choices=("memory", "speed", "fp8", "parity"), default=None)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="run only the rows whose name contains one of these (the first row always runs)",
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {a.threads} thread(s)")
    lean = lean_modes(a) if a.only in (None, "memory", "speed") else None
    fp8 = fp8_losses(a) if a.only in (None, "fp8") else None
    parity = parity_losses(a) if a.only == "parity" else None  # ~15 min: asked for by name
    print(report(lean, fp8, parity))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"lean": lean, "fp8": fp8, "parity": parity}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
