"""What the checkpoint manifest (SHA-256 of every file, issue 14) costs a save and a load.

Saves the same prepared model + AdamW state with ``Accelerator.save_state`` in interleaved rounds, with the
manifest (as shipped) and without it (``write_manifest`` replaced by a no-op), and times each save (wall
clock: a save is disk I/O and fsync). Then times ``verify_manifest`` alone (the hashing, files in the page
cache) and ``load_state`` (which verifies, then reads). Reports medians, ranges, the hash speed in MB/s and
the ratio save-with-manifest / save-without.

    python -m benchmarks.checkpoint_hash                  # ~100M parameters' worth of files, 5 rounds
    python -m benchmarks.checkpoint_hash --width 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mixprec.checkpoint.folder_format as state_module
from mixprec import Accelerator
from mixprec.checkpoint import verify_manifest


class _NoHasher:
    """The save without a manifest: nothing hashed, in the background or after."""

    def add(self, path: object) -> None:
        pass

    def close(self) -> None:
        pass


def build(width: int, layers: int) -> tuple[Accelerator, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(mixed_precision="fp32", verbose=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # AdamW's two moments exist: the optimizer file is twice the model's
    return accelerator, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator, model = build(args.width, args.layers)
    real = (state_module.write_manifest, state_module.BackgroundHasher)
    none = (lambda folder, hasher=None: None, _NoHasher)
    times: dict[str, list[float]] = {"with manifest": [], "without manifest": []}
    verify, load = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        target = Path(base) / "checkpoint"
        accelerator.save_state(target)  # warm-up: allocations, page cache
        for r in range(args.rounds):
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for variant in order:
                state_module.write_manifest, state_module.BackgroundHasher = (
                    real if variant == "with manifest" else none
                )
                start = time.perf_counter()
                accelerator.save_state(target)
                times[variant].append(time.perf_counter() - start)
            state_module.write_manifest, state_module.BackgroundHasher = real
            accelerator.save_state(target)
            start = time.perf_counter()
            assert verify_manifest(target) is None
            verify.append(time.perf_counter() - start)
            start = time.perf_counter()
            accelerator.load_state(target)
            load.append(time.perf_counter() - start)
        size = sum(p.stat().st_size for p in target.iterdir())
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = size / 1e6
    report = {
        "checkpoint_mb": round(mb, 1),
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "save_s": {k: round(v, 3) for k, v in med.items()},
        "save_range_s": {k: [round(min(v), 3), round(max(v), 3)] for k, v in times.items()},
        "save_ratio_with_over_without": round(med["with manifest"] / med["without manifest"], 3),
        "paired_ratios": [round(a / b, 3) for a, b in zip(times["with manifest"], times["without manifest"])],
        "verify_s": round(statistics.median(verify), 3),
        "hash_mb_per_s": round(mb / statistics.median(verify), 0),
        "load_s_including_verify": round(statistics.median(load), 3),
        "rounds": args.rounds,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
