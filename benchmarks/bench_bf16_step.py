"""bf16-pure's optimizer step before and after the bucketed multi-tensor rewrite (issue 28), on one device.

    python -m benchmarks.bench_bf16_step                              # the 25M-parameter GPT's tensors, CPU
    python -m benchmarks.bench_bf16_step --model gpt2 --device cuda   # GPT-2 124M on a GPU
    python -m benchmarks.bench_bf16_step --baseline-rev 2252916 --rounds 15 --json step.json
    python -m benchmarks.bench_bf16_step --baseline-rev FOLDER    # optim/'s files of "before" (bf16_adamw.py, ...)

The "before" optimizer is ``Bf16AdamW`` as it stood at ``--baseline-rev`` (default: the commit this branch
started from), read with ``git show`` and loaded beside today's; both run on copies of the same bf16 weights and
gradients of the model's shapes. First, parity: three steps of each from the same weights, gradients and
generator state, and the share of elements whose bits differ (expected 0: the rewrite keeps the arithmetic and
the order of the rounding noise; a last-bit difference of a vectorised fp32 kernel can tip a rounding).
Then timing: ``--rounds`` interleaved rounds (the order alternating), one ``step()`` of each per round after two
warm-up steps; the median, the interquartile range and the ratio of medians, per rounding rule.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

BASELINE_REV = "2252916"  # the main this branch started from: the per-parameter loop
ROOT = Path(__file__).resolve().parent.parent


def load_baseline(rev: str) -> ModuleType:
    """``mixprec.optim.bf16_adamw`` (with the optim/ files it imports: noise.py and kahan.py, and since issue 25
    adamw_step.py and rounding.py) as of ``rev`` (a git revision, or a folder holding the files, for a machine
    without the repository's history), as a standalone module. A file the revision does not have is skipped."""
    folder = Path(tempfile.mkdtemp(prefix="bf16_baseline_"))
    names = ("bf16_adamw", "adamw_step", "rounding", "noise", "kahan")
    for name in names:
        if Path(rev).is_dir():
            source = Path(rev) / f"{name}.py"
            text = source.read_text() if source.exists() else None
        else:
            shown = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:src/mixprec/optim/{name}.py"], capture_output=True, text=True
            )
            text = shown.stdout if shown.returncode == 0 else None
        if text is None:
            continue
        for other in names:
            text = text.replace(f"from mixprec.optim.{other} ", f"from bf16_baseline_{other} ")
        (folder / f"bf16_baseline_{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("bf16_baseline_bf16_adamw", folder / "bf16_baseline_bf16_adamw.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shapes_of(model: str) -> list[torch.Size]:
    from mixprec.models import GPT, GPTConfig

    configs = {
        "gpt-25m": GPTConfig(block_size=128, n_layer=8, n_head=8, n_embd=512),  # bench_lean's
        "gpt2": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    }
    with torch.device("meta"):
        return [p.shape for p in GPT(configs[model]).parameters()]


def make(shapes: list[torch.Size], device: str, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g, device=device) * 0.02).to(torch.bfloat16))
        p.grad = (torch.randn(s, generator=g, device=device) * 1e-3).to(torch.bfloat16)
        params.append(p)
    return params


def parity(cls_before: type, cls_after: type, shapes, device: str, rounding: str) -> float:
    """Share of elements (weights and moments) whose bits differ after 3 steps from the same start."""
    results = []
    for cls in (cls_before, cls_after):
        params = make(shapes, device)
        opt = cls(params, lr=1e-3, weight_decay=0.1, rounding=rounding)
        torch.manual_seed(1)
        if device == "cuda":
            torch.cuda.manual_seed(1)
        for _ in range(3):
            opt.step()
        results.append([t for p in params for t in (p.detach(), *(opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")))])
    differ = sum(int((a != b).sum()) for a, b in zip(*results))
    return differ / sum(t.numel() for t in results[0])


def timed(opt: torch.optim.Optimizer, device: str) -> float:
    import time

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from mixprec.bench import summarize
    from mixprec.optim import Bf16AdamW

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt-25m", "gpt2"], default="gpt-25m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--roundings", default="stochastic,kahan")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: a shared machine)")
    p.add_argument("--baseline-rev", default=BASELINE_REV)
    p.add_argument("--json", metavar="PATH", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    before = load_baseline(a.baseline_rev).Bf16AdamW
    shapes = shapes_of(a.model)
    n = sum(s.numel() for s in shapes)
    rows = []
    for rounding in a.roundings.split(","):
        share = parity(before, Bf16AdamW, shapes, a.device, rounding)
        opts = {}
        for name, cls in (("before", before), ("after", Bf16AdamW)):
            params = make(shapes, a.device)
            opts[name] = cls(params, lr=1e-3, weight_decay=0.1, rounding=rounding)
            for _ in range(2):
                opts[name].step()
        times = {"before": [], "after": []}
        for r in range(a.rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                times[name].append(timed(opts[name], a.device))
        s = {k: summarize(v) for k, v in times.items()}
        rows.append(
            {
                "rounding": rounding,
                "differing_share": share,
                "before_s": s["before"].median,
                "before_iqr_s": s["before"].spread,
                "after_s": s["after"].median,
                "after_iqr_s": s["after"].spread,
                "speedup": s["before"].median / s["after"].median,
            }
        )
        del opts
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu, {a.threads} thread(s)"
    print(
        f"bench_bf16_step: Bf16AdamW.step() on {a.model}'s {len(shapes)} tensors ({n / 1e6:.1f}M bf16 parameters); "
        f"{where}; torch {torch.__version__}; before = {a.baseline_rev}; {a.rounds} interleaved rounds"
    )
    for r in rows:
        print(
            f"  {r['rounding']:<10} before {r['before_s'] * 1e3:8.1f} ms (IQR {r['before_iqr_s'] * 1e3:.1f})   "
            f"after {r['after_s'] * 1e3:8.1f} ms (IQR {r['after_iqr_s'] * 1e3:.1f})   {r['speedup']:.2f}x   "
            f"bits differing after 3 steps: {r['differing_share']:.2e}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "device": where, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
