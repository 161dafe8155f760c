"""Issue 28's GPU run: every figure its goals need, in one process, under a time limit (``gpu_suite --plan
issue28``). Sections run in the order of the goals they serve; one that would start after ``--time-limit``
seconds is not started and the summary says so; one that fails is recorded and the next runs.

    tests      the gpu-marked tests (pytest -m gpu), pass/fail counts
    nanogpt    benchmarks/vs_nanogpt_gpu.py (needs --nanogpt): nanoGPT vs mixprec with the chunked loss and the
               padded vocabulary, bf16 + compile, 16 x 1024
    gpt2       GPT-2 124M, eager: bf16 autocast and bf16-pure (the bf16-pure goal)
    gpt-1b     the 0.91B preset, batch 8 x 1024: bf16 + compile, fp8 + compile (the fp8 goal)
    bf16-step  benchmarks/bench_bf16_step.py on GPT-2 124M's tensors: the optimizer step before / after
    train      mixprec train --model gpt2 --precision auto --compile: what auto picks, tokens/s
    gpt2-fp8   GPT-2 124M: bf16 + compile, fp8 + compile (the layer filter), fp8 on every layer + compile

About 9 minutes on an H200 by estimate (compiles dominate): if the limit cuts the last sections, a second
call with ``--sections`` runs them.

Each section writes ``OUT/<section>.json``; ``OUT/summary.json`` and the printed summary hold the goal figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("tests", "nanogpt", "gpt2", "gpt-1b", "bf16-step", "train", "gpt2-fp8")
# seconds each needs at least (compiles dominate; guesses until a GPU session measures them): a section is
# started only if this much time is left
MIN_SECONDS = {"tests": 60, "nanogpt": 100, "gpt2": 30, "gpt-1b": 120, "bf16-step": 20, "train": 90, "gpt2-fp8": 120}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A subprocess on this checkout's code (src/ first on the path)."""
    paths = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def tests(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    proc = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "tests",
            "-p",
            "no:cacheprovider",
            f"--junitxml={out / 'gpu_tests.xml'}",
        ],
        timeout=max(left - 5, 30),
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"returncode": proc.returncode, "summary": tail, "counts": counts, "failed": failed}


def nanogpt(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    from benchmarks import vs_nanogpt_gpu

    if not a.nanogpt:
        return {"not_run": "no --nanogpt checkout given"}
    argv = [
        "--nanogpt",
        a.nanogpt,
        "--steps",
        "20",
        "--variants",
        "nanogpt,mixprec+chunked",
        "--device",
        a.device,
        "--json",
        str(out / "nanogpt_rows.json"),
    ]
    args = vs_nanogpt_gpu.parse_args(argv)
    rows, header = vs_nanogpt_gpu.run(args)
    print(vs_nanogpt_gpu.format_rows(rows, header), flush=True)
    return {"header": header, "rows": [asdict(r) for r in rows]}


def _variants(a: argparse.Namespace, model: str, batch: int, steps: int, variants: list[str], left: float) -> dict:
    sub = copy.copy(a)
    sub.model, sub.batch_size, sub.seq_len, sub.steps, sub.warmup = model, batch, 1024, steps, 3
    sub.variants = variants
    sub.deadline = time.perf_counter() + left - 20  # a variant is started only if 20 s are left
    return a.variants_table(sub)


def gpt2(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    return _variants(a, "gpt2", 16, 20, ["bf16", "bf16-pure"], left)


def gpt2_fp8(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    return _variants(a, "gpt2", 16, 20, ["bf16+compile", "fp8+compile", "fp8-all+compile"], left)


def gpt_1b(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    return _variants(a, "gpt-1b", 8, 10, ["bf16+compile", "fp8+compile"], left)


def bf16_step(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    from benchmarks import bench_bf16_step

    argv = ["--model", "gpt2", "--device", a.device, "--rounds", "9", "--json", str(out / "bf16_step_rows.json")]
    if a.baseline:
        argv += ["--baseline-rev", a.baseline]
    bench_bf16_step.main(argv)
    return json.loads((out / "bf16_step_rows.json").read_text())


def train(a: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    run_dir = out / "train_gpt2"
    proc = _run(
        [
            sys.executable,
            "-m",
            "mixprec.cli.main",
            "train",
            "--model",
            "gpt2",
            "--precision",
            "auto",
            "--compile",
            "--seq-len",
            "1024",
            "--batch-size",
            "16",
            "--max-steps",
            "60",
            "--output-dir",
            str(run_dir),
        ],
        timeout=max(left - 5, 30),
    )
    summary_file = run_dir / "train_summary.json"
    result: dict[str, Any] = {"returncode": proc.returncode, "stderr_tail": proc.stderr[-1500:]}
    if summary_file.exists():
        s = json.loads(summary_file.read_text())
        keys = ("precision", "precision_reason", "auto_precision", "train_tokens_per_second", "peak_memory_bytes")
        result.update({k: s.get(k) for k in keys})
    return result


RUNNERS: dict[str, Callable[[argparse.Namespace, Path, float], dict[str, Any]]] = {
    "tests": tests,
    "nanogpt": nanogpt,
    "gpt2": gpt2,
    "gpt-1b": gpt_1b,
    "bf16-step": bf16_step,
    "train": train,
    "gpt2-fp8": gpt2_fp8,
}


def goals(results: dict[str, dict]) -> list[str]:
    """The issue's goals, each with the figure that decides it (or why it is missing)."""
    lines = []
    t = results.get("tests", {})
    lines.append(f"gpu tests: {t.get('summary', 'not run')}")

    def rows(section: str) -> dict[str, dict]:
        return {r["variant"]: r for r in results.get(section, {}).get("rows", [])}

    n = rows("nanogpt")
    if "nanogpt" in n:
        base = n["nanogpt"]
        for name in ("mixprec", "mixprec+chunked"):
            if name in n:
                r = n[name]
                lines.append(
                    f"{name} vs nanoGPT (bf16 + compile): {r['tokens_per_s'] / base['tokens_per_s']:.3f}x tokens/s "
                    f"(goal >= 1.1), peak {_gib(r['peak_mem_bytes'])} vs {_gib(base['peak_mem_bytes'])} "
                    f"(goal <=), MFU {r['mfu']:.1%} (goal >= 55%)"
                )
    g = rows("gpt2")
    if "bf16" in g and "bf16-pure" in g:
        b, p = g["bf16"], g["bf16-pure"]
        lines.append(
            f"bf16-pure vs bf16 autocast (GPT-2, eager): step {p['step_time_s'] / b['step_time_s']:.2f}x the time "
            f"(goal <= 1), peak {_gib(p['peak_mem_bytes'])} vs {_gib(b['peak_mem_bytes'])} (goal <)"
        )
    for section, label in (("gpt2-fp8", "GPT-2 124M"), ("gpt-1b", "0.91B")):
        r = rows(section)
        for fp8 in ("fp8+compile", "fp8-all+compile"):
            if "bf16+compile" in r and fp8 in r:
                ratio = r["bf16+compile"]["step_time_s"] / r[fp8]["step_time_s"]
                goal = " (goal >= 1.15)" if section == "gpt-1b" else " (auto must not pick fp8 where < 1)"
                lines.append(f"{fp8} vs bf16 + compile at {label}: {ratio:.3f}x{goal}")
    for row in results.get("bf16-step", {}).get("rows", []):
        lines.append(
            f"bf16-pure optimizer step ({row['rounding']}): {row['speedup']:.2f}x faster than before, "
            f"{row['after_s'] * 1e3:.1f} ms; bits differing {row['differing_share']:.1e}"
        )
    tr = results.get("train", {})
    if "precision" in tr:
        lines.append(
            f"mixprec train --model gpt2 auto --compile: picked {tr['precision']} "
            f"({tr.get('precision_reason')}), {tr.get('train_tokens_per_second')} tokens/s"
        )
    for name, r in results.items():
        if "error" in r or "not_run" in r:
            lines.append(f"{name}: {r.get('error') or r.get('not_run')}")
    return lines


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def run_plan(a: argparse.Namespace, variants_table: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """Run the sections of ``a.sections``; ``variants_table(args)`` is gpu_suite's run of ``args.variants``
    (printed, and returned as {"header", "rows"}), handed in so this plan imports nothing from gpu_suite,
    which calls it."""
    import torch

    a = copy.copy(a)
    a.variants_table = variants_table

    started = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s.strip() for s in (a.sections or ",".join(SECTIONS)).split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"gpu_suite --sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    results: dict[str, dict] = {}
    for name in wanted:
        left = a.time_limit - (time.perf_counter() - started)
        if left < MIN_SECONDS[name]:
            results[name] = {"not_run": f"not started: {left:.0f} s left of --time-limit {a.time_limit:.0f}"}
            continue
        print(f"\n[gpu_suite] section {name} ({left:.0f} s left)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = RUNNERS[name](a, out, left)
        except Exception as exc:  # one failed section must not cost the others' figures
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=2, default=str))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else a.device
    lines = [
        f"gpu_suite --plan issue28: {device}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"took {time.perf_counter() - started:.0f} s"
    ] + goals(results)
    print("\n" + "\n".join(lines), flush=True)
    (out / "summary.json").write_text(json.dumps({"lines": lines, "sections": results}, indent=2, default=str))
    return 0
