"""Activation (gradient) checkpointing on the built-in GPT: memory saved and time paid.

A 25M-parameter GPT (8 layers, width 512, 8 heads, 256-byte vocabulary, sequence 256) runs forward + backward
on the same batch without and with ``model.gradient_checkpointing_enable()`` (what
``TrainingArguments(gradient_checkpointing=True)`` calls). Two memory figures per variant:

- **activations kept for backward**: the bytes of the distinct tensors autograd saves during the forward pass
  (counted with ``torch.autograd.graph.saved_tensors_hooks``: exact, independent of the allocator and of the
  neighbours on a shared machine); with checkpointing only each block's input is kept, the rest recomputed;
- **peak memory of the step**: on CUDA ``torch.cuda.max_memory_allocated`` over the step; on the CPU the
  process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs just before the step)
  minus its size before the step, each variant in a fresh process, with glibc's mmap threshold fixed at
  128 KiB so every large tensor is its own mapping and freeing it gives the memory back (by default glibc
  raises the threshold after the first large free and then serves big tensors from a heap it does not
  shrink, which hides most of the saving: measured 618 vs 529 MiB that way).

Step time: the variants alternate for ``--rounds`` rounds after a warm-up; the median per variant and the
median paired ratio are reported (CPU time of this process with one thread by default, as the other scripts).

    python -m benchmarks.bench_checkpointing              # about 1-2 min on the 2-core dev box
    python -m benchmarks.bench_checkpointing --batch 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from mixprec.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, block_size=256, n_layer=8, n_head=8, n_embd=512)


def build(checkpointing: bool, device: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def batch(size: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (size, CONFIG.block_size), generator=g).to(device)


def saved_activation_bytes(model: GPT, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def peak_step_bytes(checkpointing: bool, size: int, device: str) -> int:
    """Peak memory of one forward + backward beyond what was held before it (see the module docstring)."""
    model, ids = build(checkpointing, device), batch(size, device)
    for p in model.parameters():  # the gradients' memory exists in both variants: allocate it first
        p.grad = torch.zeros_like(p)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark (VmHWM) to the current size
    before = _status_bytes("VmRSS")
    model(ids, labels=ids).loss.backward()
    peak = _status_bytes("VmHWM")
    return peak - before


def time_steps(size: int, device: str, rounds: int, clock) -> dict[str, list[float]]:
    models = {name: build(name == "checkpointing", device) for name in ("plain", "checkpointing")}
    ids = batch(size, device)
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():  # warm-up
        model(ids, labels=ids).loss.backward()
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            model = models[name]
            model.zero_grad(set_to_none=True)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = clock()
            model(ids, labels=ids).loss.backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(clock() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--peak-only", choices=("plain", "checkpointing"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.peak_only:  # the child process of the CPU peak measurement
        print(peak_step_bytes(args.peak_only == "checkpointing", args.batch, args.device))
        return

    n_params = build(False, "cpu").num_parameters()
    saved = {
        name: saved_activation_bytes(build(name == "checkpointing", args.device), batch(args.batch, args.device))
        for name in ("plain", "checkpointing")
    }
    peak = {}
    for name in ("plain", "checkpointing"):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_checkpointing",
            "--peak-only",
            name,
            "--batch",
            str(args.batch),
            "--device",
            args.device,
            "--threads",
            str(args.threads),
        ]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # see the module docstring
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        peak[name] = int(out.split()[-1])
    clock = time.process_time if args.clock == "cpu" and args.device == "cpu" else time.perf_counter
    times = time_steps(args.batch, args.device, args.rounds, clock)
    ratios = [c / p for p, c in zip(times["plain"], times["checkpointing"])]

    mib = 2.0**20
    print(
        f"GPT {n_params / 1e6:.1f}M params, batch {args.batch} x {CONFIG.block_size}, {args.device}, fp32, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}"
    )
    print(f"{'':24} {'plain':>10} {'checkpointing':>14} {'ratio':>7}")
    print(
        f"{'activations kept (MiB)':24} {saved['plain'] / mib:10.1f} {saved['checkpointing'] / mib:14.1f} "
        f"{saved['checkpointing'] / saved['plain']:7.3f}"
    )
    print(
        f"{'peak of the step (MiB)':24} {peak['plain'] / mib:10.1f} {peak['checkpointing'] / mib:14.1f} "
        f"{peak['checkpointing'] / peak['plain']:7.3f}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{'step time (s, median)':24} {med['plain']:10.3f} {med['checkpointing']:14.3f} "
        f"{statistics.median(ratios):7.3f}  (paired ratio range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "params": n_params,
                    "batch": args.batch,
                    "device": args.device,
                    "saved_bytes": saved,
                    "peak_bytes": peak,
                    "step_seconds": times,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
