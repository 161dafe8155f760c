"""How long a checkpoint stops training: ``save_state(async_save=True)`` against the synchronous save.

Each round runs, for each of three variants in a rotating order, one training step, then the variant's save
("sync", "async", or "none": no save), then the next step, timed:

- held: the time ``save_state`` holds the loop (wall clock). Synchronous: the whole save (serialise, write,
  fsync, SHA-256 manifest, rename). Asynchronous: the walk of the state, the small states and the rank's RNG
  state; the host copy of the model and optimizer tensors runs on the writer thread, and the next optimizer
  step waits for it.
- copy wait: the time the next step waits for the writer's copy (``BackgroundWriter.fence``, timed here).
- stall = held + copy wait (issue 24's "a save stalls the step", counted honestly when the copy is deferred).
- step excess: the next ``optimizer.step()`` against the same call after no save (difference of medians): the
  copy wait plus what the writer, busy writing beside it (the interpreter lock, the cores), costs it.
- extra wall: save + the next whole step (forward, backward, optimizer step) against the next step alone
  (difference of medians): everything the save costs the loop, the writer's competition for the cores included.

An asynchronous save is waited for after the next step (untimed), so the rounds measure one save, not two
competing for the disk. Reports medians and ranges, and the ratios async / sync (the issue's goal: <= 10%).

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
from mixprec.checkpoint.background import BackgroundWriter

_fence = getattr(BackgroundWriter, "fence", None)  # None: code that copies before save_state returns
_fence_waited = [0.0]


def _timed_fence(self: BackgroundWriter) -> None:
    start = time.perf_counter()
    _fence(self)  # type: ignore[misc]
    _fence_waited[0] += time.perf_counter() - start


if _fence is not None:
    BackgroundWriter.fence = _timed_fence  # before build(): the prepared optimizer keeps the bound method


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


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> float:
    """One step; returns how long its ``optimizer.step()`` took."""
    accelerator.backward(model(batch, labels=batch).loss)
    start = time.perf_counter()
    optimizer.step()
    took = time.perf_counter() - start
    optimizer.zero_grad()
    return took


MODES = ("sync", "async", "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a built-in GPT preset, or gpt2 (124M; needs transformers)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator, model, optimizer, batch, params = build(args.model)
    root = Path(args.dir or tempfile.mkdtemp(prefix="mixprec-async-"))
    held: dict[str, list[float]] = {m: [] for m in MODES}
    opt_step: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    waited: list[float] = []
    written: list[float] = []
    size = 0
    try:
        for r in range(args.rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:  # each variant first, second and third in turn
                train_step(accelerator, model, optimizer, batch)
                target = root / f"{mode}-{r}"
                start = time.perf_counter()
                if mode != "none":
                    accelerator.save_state(target, async_save=mode == "async")
                held[mode].append(time.perf_counter() - start)
                _fence_waited[0] = 0.0
                opt_step[mode].append(train_step(accelerator, model, optimizer, batch))
                wall[mode].append(time.perf_counter() - start)
                if mode == "async":
                    waited.append(_fence_waited[0])
                if mode == "none":
                    continue
                accelerator.wait_for_checkpoint()
                if mode == "async":
                    written.append(time.perf_counter() - start)
                size = sum(f.stat().st_size for f in target.iterdir())
                shutil.rmtree(target)
    finally:
        accelerator.end_training()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {
        name: {m: statistics.median(t[m]) for m in MODES}
        for name, t in (("held", held), ("step", opt_step), ("wall", wall))
    }
    stall = {"sync": med["held"]["sync"], "async": med["held"]["async"] + statistics.median(waited)}
    excess = {m: med["step"][m] - med["step"]["none"] for m in ("sync", "async")}
    extra = {m: med["wall"][m] - med["wall"]["none"] for m in ("sync", "async")}
    result = {
        "model": args.model,
        "parameters": params,
        "checkpoint_bytes": size,
        "rounds": args.rounds,
        "held_s": {m: {"median": med["held"][m], "min": min(held[m]), "max": max(held[m])} for m in ("sync", "async")},
        "copy_wait_s": {"median": statistics.median(waited), "max": max(waited)},
        "next_optimizer_step_s": {m: med["step"][m] for m in MODES},
        "stall_s": stall,
        "step_excess_s": excess,
        "extra_wall_s": extra,
        "async_written_after_s": statistics.median(written),
        "ratio_held_async_over_sync": med["held"]["async"] / med["held"]["sync"],
        "ratio_async_over_sync": stall["async"] / stall["sync"],
        "ratio_with_step_excess": (stall["async"] - statistics.median(waited) + excess["async"])
        / (stall["sync"] + excess["sync"]),
        "ratio_extra_wall_async_over_sync": extra["async"] / extra["sync"],
    }
    print(f"{args.model}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e6:.0f} MB, {args.rounds} rounds")
    for m in ("sync", "async"):
        print(
            f"  save_state held the loop, {m:>5}: median {med['held'][m] * 1e3:.2f} ms "
            f"(range {min(held[m]) * 1e3:.2f}-{max(held[m]) * 1e3:.2f})"
        )
    wait_ms = [t * 1e3 for t in waited]
    print(
        f"  async: the next step waited for the copy: median {statistics.median(wait_ms):.2f} ms "
        f"(max {max(wait_ms):.2f})"
    )
    print("  next optimizer.step(), median: " + ", ".join(f"after {m} {med['step'][m] * 1e3:.2f} ms" for m in MODES))
    for m in ("sync", "async"):
        print(
            f"  {m:>5}: stall (held + copy wait) {stall[m] * 1e3:.2f} ms, step excess {excess[m] * 1e3:.2f} ms, "
            f"extra wall of save + next step {extra[m] * 1e3:.2f} ms"
        )
    print(f"  async: folder committed {result['async_written_after_s']:.3f} s after the call (median)")
    print(
        f"  ratio async / sync: held {result['ratio_held_async_over_sync']:.3f}, stall "
        f"{result['ratio_async_over_sync']:.3f}, held + step excess {result['ratio_with_step_excess']:.3f}, "
        f"extra wall {result['ratio_extra_wall_async_over_sync']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
