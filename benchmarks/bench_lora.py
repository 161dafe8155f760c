"""LoRA on a frozen fp16/bf16 base against a full fine-tune with fp32 master weights: the memory each holds.

    python -m benchmarks.bench_lora                    # bf16, 63M parameters: ~2 min on the 2-core dev box
    python -m benchmarks.bench_lora --precision fp16 --layers 2 --width 256 --vocab 2048   # fp16 is emulated on
                                                       # most CPUs (~25x slower than bf16): a smaller model
    python -m benchmarks.bench_lora --layers 12 --vocab 50257 --json lora.json   # GPT-2 124M's shape

A GPT-2-like model from a config (``--layers`` x ``--width``, vocabulary ``--vocab``; nothing downloads), trained
through ``mixprec.Accelerator`` with AdamW on the same batches (``--batch`` x ``--seq`` tokens) in each variant
(``variants()``; add a row by adding an entry), all under ``--precision``'s autocast (bf16 or fp16):

- full fine-tune: the fp32 model, every weight trainable (fp32 masters: the model's own weights), and the
  model in bf16/fp16 whose every weight gets an fp32 master copy (what :mod:`mixprec.precision.master_weights`
  does for trainable low-precision parameters);
- LoRA (peft, rank ``--rank`` on ``c_attn``, ``c_proj`` and ``c_fc``): on the fp32 base, and on a frozen bf16
  / fp16 base with peft's fp32 adapters (``autocast_adapter_dtype=True``, its default) or half adapters that
  get fp32 masters.

Columns, each from the run itself:

- weights: the model's parameters in their dtypes (the base as loaded, plus adapters), counted from the
  tensors; held before the measured work begins.
- training state: fp32 masters + gradients (one per trainable tensor, in its dtype; a master's fp32 one too)
  + optimizer states (Adam's two moments), counted from the tensors after a step.
- peak growth: the process's peak-RSS growth while preparing the model and optimizer and running 2 steps
  (:func:`mixprec.bench.memory.measure_run`, after a warm-up variant): states, gradients, activations and
  autocast's cast copies, above the held weights.
- total: weights + peak growth, and its ratio to the full fine-tune in fp32 masters under the same autocast.
- checkpoint: the size of the folder ``Accelerator.save_state`` writes after those steps (weights,
  optimizer state with the masters, scaler, RNG): a peft model's holds its adapters only.
- step: median wall time of ``--steps`` further steps, each variant's right after its measurement (not
  interleaved: keeping every variant alive to interleave them would hold several GiB at once; the figure this
  script is for is memory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec import Accelerator
from mixprec.bench.memory import measure_run
from mixprec.precision.master_weights import master_map

MIB = 2**20
TARGETS = ["c_attn", "c_proj", "c_fc"]


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    base_dtype: torch.dtype
    lora: bool
    adapters_in_fp32: bool = True
    baseline: str = ""
    """The full fine-tune this variant's total is compared with (same autocast)."""


def variants(precision: str) -> list[Variant]:
    """The rows for one autocast dtype (bf16 or fp16): the two full fine-tunes, then LoRA three ways."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}[low]
    full = f"full FT, fp32 model, {precision} autocast"
    return [
        Variant(full, precision, torch.float32, lora=False),
        Variant(f"full FT, {half} model + fp32 masters", precision, low, lora=False, baseline=full),
        Variant(f"LoRA on fp32 base, {precision} autocast", precision, torch.float32, lora=True, baseline=full),
        Variant(f"LoRA on frozen {half} base (peft's fp32 adapters)", precision, low, lora=True, baseline=full),
        Variant(
            f"LoRA on frozen {half} base ({half} adapters + fp32 masters)",
            precision,
            low,
            lora=True,
            adapters_in_fp32=False,
            baseline=full,
        ),
    ]


def gpt2_config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=args.width // 64
    )


def build_base(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The model as a user loads it (``from_pretrained(..., dtype=...)``): initialised the same way each time."""
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def with_adapters(model: torch.nn.Module, variant: Variant, rank: int) -> torch.nn.Module:
    if not variant.lora:
        return model
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0, fan_in_fan_out=True)
    return peft.get_peft_model(model, config, autocast_adapter_dtype=variant.adapters_in_fp32)


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(4)]


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Run:
    """One variant: the Accelerator, the prepared model and optimizer, and its step."""

    def __init__(self, base: torch.nn.Module, variant: Variant, rank: int) -> None:
        self.model = with_adapters(base, variant, rank)
        self.accelerator = Accelerator(mixed_precision=variant.precision, verbose=False)
        optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        self.model, self.optimizer = self.accelerator.prepare(self.model, optimizer)

    def step(self, ids: torch.Tensor) -> float:
        loss = self.model(input_ids=ids, labels=ids).loss
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def state_bytes(self) -> dict[str, int]:
        """Counted from the tensors after a step (its gradients already freed: counted as they would be)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        masters = list(master_map(self.optimizer.optimizer).values())
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        return {
            "weights": nbytes(self.model.parameters()),
            "trainable_params": sum(p.numel() for p in trainable),
            "masters": nbytes(masters),
            "grads": nbytes(trainable) + nbytes(masters),
            "optimizer_states": nbytes(states),
        }


def measure(variant: Variant, args: argparse.Namespace, data: list[torch.Tensor]) -> dict[str, Any]:
    config = gpt2_config(args)
    held: dict[str, Any] = {}

    def prepare() -> Callable[[], None]:
        held["base"] = build_base(config, variant.base_dtype)

        def run() -> None:
            held["run"] = Run(held.pop("base"), variant, args.rank)
            for ids in data[:2]:
                held["run"].step(ids)

        return run

    peak = measure_run(prepare, "cpu")
    run: Run = held.pop("run")
    counts = run.state_bytes()
    with tempfile.TemporaryDirectory() as tmp:  # what a checkpoint of this run writes (Accelerator.save_state)
        folder = run.accelerator.save_state(Path(tmp) / "state")
        counts["checkpoint"] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        run.step(data[2 + i % 2])
        times.append(time.perf_counter() - start)
    return {"variant": variant.name, **counts, "peak_growth": peak.peak_bytes if peak else 0, "times": times}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (default: 3)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = batches(args)
    chosen = variants(args.precision)

    # warm-up: first-use costs (library code paged in, kernel caches) must not land in the first variant's peak
    for v in (chosen[0], chosen[-1]):
        measure(v, argparse.Namespace(**{**vars(args), "layers": 1, "steps": 0}), data[:2])
    results = []
    for v in chosen:
        results.append(measure(v, args, data))
        print(f"  measured: {v.name}", flush=True)

    by_name = {r["variant"]: r for r in results}
    rows = []
    for v, r in zip(chosen, results):
        total = r["weights"] + r["peak_growth"]
        base = by_name[v.baseline or v.name]
        rows.append(
            {
                "variant": v.name,
                "trainable_params": r["trainable_params"],
                "weights_mib": r["weights"] / MIB,
                "training_state_mib": (r["masters"] + r["grads"] + r["optimizer_states"]) / MIB,
                "masters_mib": r["masters"] / MIB,
                "peak_growth_mib": r["peak_growth"] / MIB,
                "total_mib": total / MIB,
                "checkpoint_mib": r["checkpoint"] / MIB,
                "vs_full_ft": total / (base["weights"] + base["peak_growth"]),
                "step_ms_median": 1000 * statistics.median(r["times"]) if r["times"] else None,
            }
        )
    n = sum(p.numel() for p in build_base(gpt2_config(args), torch.float32).parameters())
    print(
        f"GPT-2-like {args.layers} x {args.width}, vocab {args.vocab} ({n / 1e6:.1f}M parameters), batch "
        f"{args.batch} x {args.seq}, {args.precision} autocast, LoRA r={args.rank} on {', '.join(TARGETS)}, "
        f"AdamW, {args.threads} thread(s)"
    )
    columns = [
        "variant",
        "trained",
        "weights",
        "training state (masters)",
        "peak growth",
        "total",
        "vs full FT",
        "checkpoint",
        "step",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        step = f"{row['step_ms_median']:.0f} ms" if row["step_ms_median"] is not None else "-"
        cells = [
            row["variant"],
            f"{row['trainable_params'] / 1e6:.2f}M",
            f"{row['weights_mib']:.1f} MiB",
            f"{row['training_state_mib']:.1f} MiB ({row['masters_mib']:.1f})",
            f"{row['peak_growth_mib']:.0f} MiB",
            f"{row['total_mib']:.0f} MiB",
            f"{row['vs_full_ft']:.2f}x",
            f"{row['checkpoint_mib']:.1f} MiB",
            step,
        ]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        meta = {
            "args": vars(args),
            "parameters": n,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
