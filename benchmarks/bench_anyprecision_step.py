"""AnyPrecisionAdamW's step before and after it shared Bf16AdamW's bucketed step (issue 25), on one device.

    python -m benchmarks.bench_anyprecision_step                   # the 25M-parameter GPT's tensors, CPU
    python -m benchmarks.bench_anyprecision_step --model gpt2 --device cuda --rounds 15

The "before" optimizer is the per-parameter loop of ``src/mixprec/trainer/anyprecision.py`` at ``--baseline-rev``
(default: the commit issue 25's branch started from), read with ``git show`` and loaded beside today's; both step
copies of the same fp32 weights and gradients of the model's shapes, for each option set (fp32 moments, bf16
moments). First, parity: the largest weight difference after three steps from the same start (the arithmetic is
the same AdamW; fp32 operation order differs). Then timing: ``--rounds`` interleaved rounds (the order
alternating), one ``step()`` of each per round after two warm-up steps; the median, the interquartile range and
the ratio of medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.bench_bf16_step import ROOT, shapes_of, timed

BASELINE_REV = "50740e4"  # the main issue 25's branch started from: AnyPrecisionAdamW's own loop
OPTIONS = {
    "fp32 moments": {},
    "bf16 moments": {"momentum_dtype": torch.bfloat16, "variance_dtype": torch.bfloat16},
}


def load_baseline(rev: str) -> ModuleType:
    """``mixprec.trainer.anyprecision`` as of ``rev``, as a standalone module (it imports only optim/kahan.py,
    whose ``kahan_update_`` is unchanged)."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/mixprec/trainer/anyprecision.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="anyprecision_baseline_")) / "anyprecision_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("anyprecision_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(shapes: list[torch.Size], device: str, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g, device=device) * 0.02)
        p.grad = torch.randn(s, generator=g, device=device) * 1e-3
        params.append(p)
    return params


def main(argv: list[str] | None = None) -> int:
    from mixprec.bench import summarize
    from mixprec.optim import AnyPrecisionAdamW

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt-25m", "gpt2"], default="gpt-25m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: a shared machine)")
    p.add_argument("--baseline-rev", default=BASELINE_REV)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    before = load_baseline(a.baseline_rev).AnyPrecisionAdamW
    shapes = shapes_of(a.model)
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu, {a.threads} thread(s)"
    print(
        f"bench_anyprecision_step: AnyPrecisionAdamW.step() on {a.model}'s {len(shapes)} tensors "
        f"({sum(s.numel() for s in shapes) / 1e6:.1f}M fp32 parameters); {where}; torch {torch.__version__}; "
        f"before = {a.baseline_rev}; {a.rounds} interleaved rounds"
    )
    for label, options in OPTIONS.items():
        opts, weights = {}, {}
        for name, cls in (("before", before), ("after", AnyPrecisionAdamW)):
            weights[name] = make(shapes, a.device)
            opts[name] = cls(weights[name], lr=1e-3, weight_decay=0.1, **options)
            for _ in range(3):
                opts[name].step()
        with torch.no_grad():
            apart = max(float((x - y).abs().max()) for x, y in zip(weights["before"], weights["after"]))
        times: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(a.rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                times[name].append(timed(opts[name], a.device))
        s = {k: summarize(v) for k, v in times.items()}
        old, new = s["before"], s["after"]
        print(
            f"  {label:<13} before {old.median * 1e3:8.1f} ms (IQR {old.spread * 1e3:.1f})   "
            f"after {new.median * 1e3:8.1f} ms (IQR {new.spread * 1e3:.1f})   {old.median / new.median:.2f}x   "
            f"max |weight difference| after 3 steps: {apart:.1e}"
        )
        del opts, weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
