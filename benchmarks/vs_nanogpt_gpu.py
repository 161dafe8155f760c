"""mixprec's GPT step against nanoGPT's, in one process: same shape, same batches, interleaved (issue 28).

    python -m benchmarks.vs_nanogpt_gpu --nanogpt ~/nanoGPT                         # GPT-2 124M, 16 x 1024, bf16
    python -m benchmarks.vs_nanogpt_gpu --nanogpt ~/nanoGPT --no-compile --steps 10
    python -m benchmarks.vs_nanogpt_gpu --nanogpt ~/nanoGPT --profile traces/     # + torch.profiler, top kernels
    python -m benchmarks.vs_nanogpt_gpu --nanogpt ~/nanoGPT --device cpu --preset tiny --batch-size 2 --seq-len 32

``--nanogpt`` is a checkout of https://github.com/karpathy/nanoGPT (its ``model.py`` is imported from there;
nothing is copied or downloaded). Variants (``--variants``, default all but nanogpt-padded):

- ``nanogpt``          nanoGPT's ``GPT`` at the given vocabulary (50257), ``bias=False`` (its default)
- ``nanogpt-padded``   the same at its padded vocabulary (50304, nanoGPT's ``GPTConfig`` default)
- ``mixprec``          mixprec's ``GPT`` with nanoGPT's settings (``bias=False``, the same vocabulary)
- ``mixprec+padded``   + ``vocab_multiple=64`` (the head's matmuls on 50304 rows; the extra logits cut off)
- ``mixprec+chunked``  + ``loss_chunk_size`` (models/chunked_loss.py: no (tokens x vocab) fp32 logits)

Every variant: bf16 autocast (``resolve_precision("bf16")``), nanoGPT's optimizer (fused AdamW on CUDA, weight
decay 0.1 on the matrices only, betas 0.9/0.95, lr 6e-4), ``torch.compile`` of the model unless
``--no-compile``; mixprec's variants run ``mixprec.bench.train_step`` (the precision's autocast and its
non-finite guard), nanoGPT's its own ``model(x, y)`` loss. Batches are random token ids, the same for all;
nanoGPT's loss covers T positions per row, mixprec's T - 1 (labels shifted inside, HF's convention).

Measured: warm-up steps (compilation) per variant, then ``--steps`` rounds of one step per variant, the order
rotating each round, each step timed with CUDA events (one sync per variant at the end). Per variant: median
step time and IQR, tokens/s, MFU (nanoGPT's 6N + 12 L d T flops per token, N of the unpadded model, against the
measured bf16 matmul peak), peak memory: the variant's own parameters and optimizer state plus the largest
growth of ``max_memory_allocated`` over one of its steps (what it would peak at alone, the other variants'
resident state left out). Ratios are to ``nanogpt``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("nanogpt", "nanogpt-padded", "mixprec", "mixprec+padded", "mixprec+chunked")
DEFAULT_VARIANTS = ("nanogpt", "mixprec", "mixprec+padded", "mixprec+chunked")
PRESETS = {  # nanoGPT's GPTConfig fields
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50257},
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 300},
}
PAD_MULTIPLE = 64  # nanoGPT's: 50257 -> 50304


@dataclass
class Arm:
    """One variant: its model, optimizer, step function and what was measured."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    state_bytes: int
    times: list[float] = field(default_factory=list)
    step_growth: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)
    warmup_s: float = 0.0
    timer: Any = None


@dataclass
class Row:
    variant: str
    warmup_s: float
    step_time_s: float
    step_time_iqr_s: float
    tokens_per_s: float
    mfu: float
    peak_mem_bytes: int | None
    final_loss: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", metavar="PATH", required=True, help="a nanoGPT checkout (the folder of model.py)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's block size")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of every variant each)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (compilation)")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of mixprec+chunked's loss")
    p.add_argument("--no-compile", action="store_true", help="eager models (torch.compile by default)")
    p.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile's mode for every variant (e.g. reduce-overhead: CUDA graphs; max-autotune-no-cudagraphs)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", metavar="DIR", default=None, help="write a torch.profiler trace per variant")
    p.add_argument("--json", metavar="PATH", default=None)
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    model_py = Path(a.nanogpt).expanduser() / "model.py"
    if not model_py.is_file():
        p.error(f"--nanogpt {a.nanogpt}: no model.py there; pass the folder of a nanoGPT checkout")
    a.model_py = model_py
    a.seq_len = a.seq_len or PRESETS[a.preset]["block_size"]
    for name in ("batch_size", "seq_len", "steps", "warmup", "loss_chunk"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.seq_len > PRESETS[a.preset]["block_size"]:
        p.error(f"--seq-len {a.seq_len} exceeds the preset's block size {PRESETS[a.preset]['block_size']}")
    return a


def load_nanogpt(model_py: Path) -> Any:
    """nanoGPT's model.py as a module (imported from the user's checkout)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def padded(vocab: int) -> int:
    return -(-vocab // PAD_MULTIPLE) * PAD_MULTIPLE


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's optimizer groups: weight decay on tensors of 2+ dimensions (matmuls, embeddings) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters plus optimizer state, each tensor once (the tied embedding is one)."""
    seen: dict[int, int] = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                seen[id(v)] = v.numel() * v.element_size()
    return sum(seen.values())


def build(name: str, a: argparse.Namespace, nanogpt: Any, device: torch.device) -> Arm:
    from mixprec.bench import train_step
    from mixprec.models import GPT, GPTConfig
    from mixprec.precision import resolve_precision

    shape = dict(PRESETS[a.preset])
    precision = resolve_precision("bf16", device)
    fused = device.type == "cuda"
    torch.manual_seed(0)
    if name.startswith("nanogpt"):
        vocab = padded(shape["vocab_size"]) if name == "nanogpt-padded" else shape["vocab_size"]
        model = nanogpt.GPT(nanogpt.GPTConfig(**{**shape, "vocab_size": vocab}, dropout=0.0, bias=False))
    else:
        extra = {"vocab_multiple": PAD_MULTIPLE} if name != "mixprec" else {}
        if name == "mixprec+chunked":
            extra["loss_chunk_size"] = a.loss_chunk
        model = GPT(GPTConfig(**shape, dropout=0.0, bias=False, **extra))
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(decay_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=fused)
    runnable = model if a.no_compile else torch.compile(model, mode=a.compile_mode)

    if name.startswith("nanogpt"):

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with precision.autocast():
                _, loss = runnable(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

    else:
        scaler = precision.make_scaler()

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return train_step(runnable, {"input_ids": x, "labels": x}, precision, optimizer, scaler)

    return Arm(name, model, optimizer, step, state_bytes=0)


def run(a: argparse.Namespace) -> tuple[list[Row], str]:
    from mixprec.bench import make_timer, measure_peak_flops, summarize
    from mixprec.models import GPT, GPTConfig

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    nanogpt = load_nanogpt(a.model_py)
    shape = PRESETS[a.preset]
    with torch.device("meta"):  # useful flops: the unpadded model's, the same for every variant
        flops_per_token = GPT(GPTConfig(**shape, bias=False)).estimate_flops_per_token(a.seq_len)
    peak = measure_peak_flops(torch.bfloat16, device, repeats=5)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, shape["vocab_size"], (a.batch_size, a.seq_len + 1), generator=g) for _ in range(4)]
    # (x, y) with y one position ahead, contiguous (nanoGPT's loss views them flat)
    batches = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]
    arms = []
    for name in a.variants:
        arm = build(name, a, nanogpt, device)
        t0 = time.perf_counter()
        for i in range(a.warmup):
            arm.step(*batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        arm.warmup_s = time.perf_counter() - t0
        arm.state_bytes = state_bytes(arm.model, arm.optimizer)
        arm.timer = make_timer(device)
        arms.append(arm)
        print(f"[vs_nanogpt] {name}: warmed up in {arm.warmup_s:.1f} s", file=sys.stderr, flush=True)
    for r in range(a.steps):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]  # rotate: no variant always runs first
        for arm in order:
            if cuda:
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            arm.timer.start()
            arm.losses.append(arm.step(*batches[r % len(batches)]))
            arm.timer.stop()
            if cuda:
                arm.step_growth = max(arm.step_growth, torch.cuda.max_memory_allocated() - before)
    rows = []
    tokens = a.batch_size * a.seq_len
    for arm in arms:
        s = summarize(arm.timer.times())
        rows.append(
            Row(
                variant=arm.name,
                warmup_s=arm.warmup_s,
                step_time_s=s.median,
                step_time_iqr_s=s.spread,
                tokens_per_s=tokens / s.median,
                mfu=flops_per_token * tokens / s.median / peak.flops_per_s,
                peak_mem_bytes=arm.state_bytes + arm.step_growth if cuda else None,
                final_loss=float(torch.stack(arm.losses[-3:]).float().mean()),
            )
        )
    if a.profile:
        profile(arms, batches[0], Path(a.profile), device)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    mode = "eager" if a.no_compile else f"torch.compile (mode {a.compile_mode or 'default'})"
    header = (
        f"vs_nanogpt: {a.preset} (batch {a.batch_size} x {a.seq_len}), bf16 autocast, {mode}, "
        f"fused AdamW={cuda}; {name}; torch {torch.__version__}; {a.warmup} warm-up steps per variant, "
        f"{a.steps} interleaved rounds; peak bf16 {peak.source}"
    )
    return rows, header


def profile(arms: list[Arm], batch: tuple[torch.Tensor, torch.Tensor], folder: Path, device: torch.device) -> None:
    """Three steps of each variant under torch.profiler: a Chrome trace per variant and its top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for arm in arms:
        with torch_profile(activities=activities) as prof:
            for _ in range(3):
                arm.step(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(folder / f"{arm.name.replace('+', '_')}.json"))
        print(f"\n[profile] {arm.name}: top ops by {key} (3 steps)")
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))


def format_rows(rows: list[Row], header: str) -> str:
    base = next((r for r in rows if r.variant == "nanogpt"), None)
    cols = ["variant", "warm-up", "step (median)", "IQR", "tokens/s", "MFU", "peak mem", "vs nanogpt", "loss"]
    table = [
        [
            r.variant,
            f"{r.warmup_s:.1f} s",
            f"{r.step_time_s * 1e3:.2f} ms",
            f"{r.step_time_iqr_s * 1e3:.2f} ms",
            f"{r.tokens_per_s:,.0f}",
            f"{r.mfu:.1%}",
            "-" if r.peak_mem_bytes is None else f"{r.peak_mem_bytes / 2**30:.2f} GiB",
            "-" if base is None else f"{base.step_time_s / r.step_time_s:.3f}x",
            f"{r.final_loss:.3f}",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [header, "", fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*t) for t in table]
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("vs_nanogpt: skipped: no CUDA device (use --device cpu --preset tiny for a dry run)", file=sys.stderr)
        return 0
    rows, header = run(a)
    print(format_rows(rows, header))
    if a.json:
        Path(a.json).write_text(json.dumps({"header": header, "results": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
