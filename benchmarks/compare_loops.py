"""The hand-written torch.amp loop (the floor) vs mixprec's GradScaler loop, Accelerator and Trainer, and
Hugging Face Accelerate and Trainer where installed: same model, data, optimiser and clipping; step time,
peak memory, and the dtype each one *actually* computed in.

All variants of a precision run in one process, each on its own copy of the same initial model. After a
warm-up (during which forward hooks on every Linear record the compute dtype, then are removed), they run
in interleaved rounds of ``--steps`` steps, the order rotating each round. Per variant: the median over
rounds of the mean step time, the interquartile range over rounds, and the median over rounds of the
paired ratio to the floor's time in the same round (robust to the machine getting slower mid-run). Peak
memory is measured afterwards for each variant on a fresh copy (see mixprec.bench.memory).

    python -m benchmarks.compare_loops                       # fp32 and fp16; about 1-2 min on the dev box
    python -m benchmarks.compare_loops --precisions fp16 --rounds 4
    python -m benchmarks.compare_loops --json loops.json     # also write the figures
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time

import torch

from benchmarks import _loops
from mixprec.bench.memory import measure_run
from mixprec.data import CausalLMDataset, load_corpus
from mixprec.models import GPT

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
GOALS = {"mixprec Accelerator": 1.02, "mixprec Trainer": 1.05}
MEMORY_TOLERANCE = 0.05
SCALING_TOLERANCE = 0.05


def _say(msg: str) -> None:
    print(f"[compare_loops] {msg}", file=sys.stderr, flush=True)


def _reset_hf_state() -> None:
    """HF Accelerate keeps its precision in a process-wide singleton; a new precision needs a fresh one."""
    if importlib.util.find_spec("accelerate") is None:
        return
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _quantiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def run_precision(precision: str, variants: list[str], a: argparse.Namespace, dataset, init_state) -> dict:
    device = torch.device(a.device)
    clock = CLOCKS[a.clock]
    s = _loops.Setup(a.model, init_state, dataset, precision, a.batch_size, a.lr, 1.0, a.seed, device)
    total = a.warmup + a.rounds * a.steps
    _reset_hf_state()
    steppers = {name: _loops.start(name, s, total) for name in variants}
    try:
        for st in steppers.values():
            st.steps(a.warmup)
            st.observer.remove()  # dtypes are known now; hooks would only add cost to the timed steps
        rounds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(a.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for name in order:
                t0 = clock()
                steppers[name].steps(a.steps)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                rounds[name].append((clock() - t0) / a.steps)
            _say(f"{precision} round {r + 1}/{a.rounds}")
    finally:
        for st in steppers.values():
            st.close()
    observed = {name: sorted(st.observer.seen) for name, st in steppers.items()}
    del steppers

    memory: dict[str, int | None] = {}
    if not a.no_memory:
        for name in variants:

            def prepare(name: str = name):
                def run() -> None:
                    st = _loops.start(name, s, a.memory_steps)
                    try:
                        st.steps(a.memory_steps)
                    finally:
                        st.close()

                return run

            # the median of a few: at a few MiB, page and allocator granularity is a visible share
            measured = [measure_run(prepare, device) for _ in range(a.memory_repeats)]
            peaks = [m.peak_bytes for m in measured if m is not None]
            memory[name] = int(statistics.median(peaks)) if peaks else None
            memory_source = measured[0].source if measured[0] else "not measured on this OS"
    floor = rounds.get(_loops.FLOOR)
    rows = []
    for name in variants:
        times = rounds[name]
        q1, q3 = _quantiles(times)
        paired = [t / f for t, f in zip(times, floor)] if floor else []
        rows.append(
            {
                "variant": name,
                "asked": precision,
                "matmul_dtypes": observed[name],
                "step_time_s": statistics.median(times),
                "step_time_iqr_s": q3 - q1,
                "ratio_vs_floor": statistics.median(paired) if paired else None,
                "ratio_range": [min(paired), max(paired)] if paired else None,
                # noise only ever adds time, so the best rounds are a second, independent estimate
                "ratio_of_best": min(times) / min(floor) if floor else None,
                "peak_mem_bytes": memory.get(name),
            }
        )
    return {"precision": precision, "rows": rows, "memory_source": memory_source if memory else None}


def _ran_as(row: dict) -> str:
    want = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[row["asked"]]
    dtypes = ", ".join(row["matmul_dtypes"]) or "?"
    return dtypes if want in row["matmul_dtypes"] else f"{dtypes} (asked {row['asked']}: NOT what was asked)"


def _goals(block: dict) -> list[str]:
    rows = {r["variant"]: r for r in block["rows"]}
    out = []
    for name, limit in GOALS.items():
        if name in rows and rows[name]["ratio_vs_floor"] is not None:
            ratio = rows[name]["ratio_vs_floor"]
            out.append(f"{name} <= {limit:.2f}x floor: {ratio:.3f}x -> {'met' if ratio <= limit else 'NOT met'}")
    ours, theirs = rows.get("mixprec Trainer"), rows.get("HF Trainer")
    if ours and theirs:
        same = ours["matmul_dtypes"] == theirs["matmul_dtypes"]
        verdict = "met" if ours["step_time_s"] < theirs["step_time_s"] else "NOT met"
        note = "" if same else f" (not like for like: HF Trainer computed in {', '.join(theirs['matmul_dtypes'])})"
        out.append(
            f"mixprec Trainer faster than HF Trainer: {ours['step_time_s'] * 1e3:.2f} vs "
            f"{theirs['step_time_s'] * 1e3:.2f} ms -> {verdict}{note}"
        )
    scaled, plain = rows.get("mixprec GradScaler"), rows.get("no loss scaling")
    if block["precision"] == "fp16" and scaled and plain:
        ratio = scaled["step_time_s"] / plain["step_time_s"]
        limit = 1 + SCALING_TOLERANCE
        out.append(
            f"fp16 with loss scaling <= {limit:.2f}x without: {ratio:.3f}x -> {'met' if ratio <= limit else 'NOT met'}"
        )
    floor = rows.get(_loops.FLOOR)
    if floor and floor["peak_mem_bytes"]:
        limit = floor["peak_mem_bytes"] * (1 + MEMORY_TOLERANCE)
        over = [n for n, r in rows.items() if n.startswith("mixprec") and (r["peak_mem_bytes"] or 0) > limit]
        worst = max(
            (r["peak_mem_bytes"] or 0) / floor["peak_mem_bytes"] for n, r in rows.items() if n.startswith("mixprec")
        )
        out.append(
            f"mixprec peak memory <= floor + {MEMORY_TOLERANCE:.0%}: worst {worst:.3f}x floor "
            f"({floor['peak_mem_bytes'] / 2**20:.1f} MiB) -> "
            + ("met" if not over else f"NOT met by {', '.join(over)}")
        )
    return out


def format_report(blocks: list[dict], header: str) -> str:
    lines = [header, ""]
    for block in blocks:
        lines.append(f"## {block['precision']}")
        cols = [
            "variant",
            "computed in",
            "step (median)",
            "IQR",
            "vs floor (median paired)",
            "range",
            "best/best",
            "peak mem",
        ]
        table = []
        for r in block["rows"]:
            ratio = "-" if r["ratio_vs_floor"] is None else f"{r['ratio_vs_floor']:.3f}x"
            rng = "-" if r["ratio_range"] is None else f"{r['ratio_range'][0]:.2f}..{r['ratio_range'][1]:.2f}"
            best = "-" if r["ratio_of_best"] is None else f"{r['ratio_of_best']:.3f}x"
            mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.1f} MiB"
            table.append(
                [
                    r["variant"],
                    _ran_as(r),
                    f"{r['step_time_s'] * 1e3:.2f} ms",
                    f"{r['step_time_iqr_s'] * 1e3:.2f} ms",
                    ratio,
                    rng,
                    best,
                    mem,
                ]
            )
        widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines += [fmt.format(*cols), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in table)]
        if block["memory_source"]:
            lines.append(f"peak mem: {block['memory_source']}")
        lines += [f"goal: {g}" for g in _goals(block)] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", default="fp32,fp16", help="comma-separated: fp32, fp16, bf16 (default fp32,fp16)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of: {', '.join(_loops.VARIANTS)}")
    p.add_argument("--model", default="tiny", help="built-in GPT preset (default tiny: loop overhead shows most)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=2)
    p.add_argument("--memory-repeats", type=int, default=3, help="peak memory: median of this many runs")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: steady on a shared box; above 1 the Trainers, which run on worker threads, "
        "can each get an OpenMP team of their own and slow every loop (not measured): see benchmarks/README.md, "
        "'A save left'",
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (default; right with 1 thread on a busy box); wall",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and a.clock == "cpu":
        a.clock = "wall"  # CPU time does not see GPU work
    torch.set_num_threads(a.threads)
    precisions = [x.strip() for x in a.precisions.split(",") if x.strip()]
    variants = [v.strip() for v in a.variants.split(",")] if a.variants else list(_loops.VARIANTS)
    unknown = [v for v in variants if v not in _loops.VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {_loops.VARIANTS}")
    missing = {v: m for v, m in _loops.NEEDS.items() if v in variants and importlib.util.find_spec(m) is None}
    for v, m in missing.items():
        _say(f"skipping {v}: {m} is not installed")
    variants = [v for v in variants if v not in missing]

    started = time.perf_counter()
    torch.manual_seed(a.seed)
    init_state = {k: v.clone() for k, v in GPT.from_preset(a.model).state_dict().items()}
    train, _ = load_corpus().split(0.1)
    dataset = CausalLMDataset(train, a.seq_len)
    blocks = []
    for precision in precisions:
        chosen = [v for v in variants if precision == "fp16" or v != "no loss scaling"]
        blocks.append(run_precision(precision, chosen, a, dataset, init_state))
    cpu = platform.processor() or platform.machine()
    header = (
        f"compare_loops: GPT {a.model!r}, batch {a.batch_size} x {a.seq_len}, AdamW lr {a.lr}, clip 1.0; "
        f"{a.warmup} warm-up + {a.rounds} rounds x {a.steps} steps; device {a.device} ({cpu}), {a.threads} "
        f"thread(s), {a.clock} clock; torch {torch.__version__}; took {time.perf_counter() - started:.0f} s"
    )
    print(format_report(blocks, header))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": header, "argv": sys.argv[1:], "blocks": blocks}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
