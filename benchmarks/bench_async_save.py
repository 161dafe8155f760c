"""How long a checkpoint stops training: ``save_state(async_save=True)`` against the synchronous save.

The stall is the time ``save_state`` holds the training loop (wall clock). Synchronous: the whole save
(serialise, write, fsync, SHA-256 manifest, rename). Asynchronous: the host copy of the model and optimizer
tensors, the small files and the rank's RNG state; the big files, the manifest and the commit run on the
writer thread afterwards (timed too, as "written after": the stall plus the background part, until
``wait_for_checkpoint`` returns). Each round runs one AdamW step, then saves once with each mode, alternating
which goes first; an asynchronous save is waited for before the next round, so the rounds measure the
stall itself, not two saves competing for the disk. Reports medians and ranges, and the ratio
stall(async) / stall(sync) (the issue's goal: <= 10%).

    python -m benchmarks.bench_async_save                     # the default `mixprec train` model ("small")
    python -m benchmarks.bench_async_save --model gpt2        # GPT-2 124M (transformers' GPT2Config(), random)
    python -m benchmarks.bench_async_save --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mixprec import Accelerator


def build(name: str) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, torch.Tensor, int]:
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config())  # 124M parameters, random weights: nothing downloaded
        vocab = model.config.vocab_size
    else:
        from mixprec.models import GPT

        model = GPT.from_preset(name)
        vocab = 256
    params = sum(p.numel() for p in model.parameters())
    accelerator = Accelerator(mixed_precision="fp32", verbose=False, cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.randint(0, vocab, (1, 32))
    return accelerator, model, optimizer, batch, params


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> None:
    accelerator.backward(model(batch, labels=batch).loss)
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a built-in GPT preset, or gpt2 (124M; needs transformers)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator, model, optimizer, batch, params = build(args.model)
    root = Path(args.dir or tempfile.mkdtemp(prefix="mixprec-async-"))
    stall: dict[str, list[float]] = {"sync": [], "async": []}
    written: list[float] = []
    size = 0
    try:
        for r in range(args.rounds):
            train_step(accelerator, model, optimizer, batch)
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                target = root / f"{mode}-{r}"
                start = time.perf_counter()
                accelerator.save_state(target, async_save=mode == "async")
                stall[mode].append(time.perf_counter() - start)
                if mode == "async":
                    accelerator.wait_for_checkpoint()
                    written.append(time.perf_counter() - start)
                size = sum(f.stat().st_size for f in target.iterdir())
                shutil.rmtree(target)
    finally:
        accelerator.end_training()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {mode: statistics.median(times) for mode, times in stall.items()}
    result = {
        "model": args.model,
        "parameters": params,
        "checkpoint_bytes": size,
        "rounds": args.rounds,
        "stall_s": {mode: {"median": med[mode], "min": min(t), "max": max(t)} for mode, t in stall.items()},
        "async_written_after_s": statistics.median(written),
        "ratio_async_over_sync": med["async"] / med["sync"],
    }
    print(f"{args.model}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e6:.0f} MB, {args.rounds} rounds")
    for mode, times in stall.items():
        print(f"  stall per save, {mode:>5}: median {med[mode]:.3f} s (range {min(times):.3f}-{max(times):.3f})")
    print(f"  async: folder committed {result['async_written_after_s']:.3f} s after the call (median)")
    print(f"  stall ratio async / sync: {result['ratio_async_over_sync']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
