"""The GPT's loss with and without ``loss_chunk_size`` (models/chunked_loss.py) at GPT-2's vocabulary, on a CPU.

    python -m benchmarks.bench_chunked_loss                 # 2 layers x 128, vocab 50257, 8 x 256 tokens, bf16
    python -m benchmarks.bench_chunked_loss --rounds 3 --json chunked.json

Variants: ``plain`` (logits over the whole vocabulary, their fp32 copy, F.cross_entropy), ``padded``
(``vocab_multiple=64``), ``chunked`` (``vocab_multiple=64, loss_chunk_size=512``). The model is small so that
the head and the loss dominate, as they do at GPT-2 124M's 16 x 1024 tokens on a GPU (issue 28). Each variant
runs in its own process (peak RSS is per process): 4 forward + backward steps under bf16 autocast, the median
of the last 3 and the growth of the peak RSS over the steps; ``--rounds`` rounds, the order alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {"plain": {}, "padded": {"vocab_multiple": 64}, "chunked": {"vocab_multiple": 64, "loss_chunk_size": 512}}

CHILD = """
import json, resource, sys, time, torch
from mixprec.models import GPT, GPTConfig
torch.set_num_threads(1)
torch.manual_seed(0)
shape = dict(vocab_size=50257, block_size=256, n_layer=2, n_head=4, n_embd=128, bias=False)
m = GPT(GPTConfig(**shape, **json.loads(sys.argv[1])))
ids = torch.randint(0, 50257, (8, 256))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(4):
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(ids, labels=ids).loss
    loss.backward()
    m.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
grow = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print(json.dumps({"step_s": sorted(times[1:])[1], "peak_rss_growth": grow, "loss": loss.item()}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", metavar="PATH", default=None)
    a = p.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(a.rounds):
        for name in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(VARIANTS[name])],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("bench_chunked_loss: GPT 2 x 128, vocab 50257, 8 x 256 tokens, bf16 autocast, 1 thread, CPU")
    rows = {}
    for name, results in runs.items():
        step = statistics.median(x["step_s"] for x in results)
        peak = statistics.median(x["peak_rss_growth"] for x in results)
        rows[name] = {"step_s": step, "peak_rss_growth": peak, "loss": results[-1]["loss"]}
        print(
            f"  {name:<8} forward+backward {step * 1e3:7.0f} ms   peak RSS growth {peak / 2**20:6.0f} MiB   "
            f"loss {results[-1]['loss']:.4f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
