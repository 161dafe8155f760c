"""``mixprec train`` against nanoGPT's ``train.py``: same corpus bytes, model, recipe and steps, interleaved (issue 23).

    python -m benchmarks.vs_nanogpt --nanogpt ~/nanoGPT                               # the main job, 300 steps
    python -m benchmarks.vs_nanogpt --nanogpt ~/nanoGPT --precision auto --rounds 3
    python -m benchmarks.vs_nanogpt --nanogpt ~/nanoGPT --precision bf16 --fp32-ops attention --steps 500

``--nanogpt`` is a checkout of https://github.com/karpathy/nanoGPT; its ``train.py`` runs as it is, in a
scratch folder holding what it reads relative to the working directory: ``data/mixprec/{train,val}.bin``
(mixprec's own train/validation split of the corpus, bytes as uint16 tokens, ``meta.pkl`` vocab 256) and a
link to its ``configurator.py``. Nothing of nanoGPT is copied or downloaded.

The same for both: the built-in GPT preset's shape (``--model``, bias on, no dropout), batch x seq-len, steps,
peak lr with 5% linear warm-up and cosine decay to 0 (the same formula, nanoGPT's get_lr, which mixprec train
uses as its "nanogpt_cosine" schedule), AdamW(0.9, 0.99) with decay 0.1, clip 1.0, and the
threads (``--threads``, OMP_NUM_THREADS for both processes). nanoGPT's ``train.py`` runs fp32 on a CPU
whatever its ``dtype`` (its autocast context is only for CUDA): that is its best setting here. Differences
kept as they are: nanoGPT draws random windows and estimates the validation loss on ``eval_iters`` random
windows of val.bin (set to the same 64 Ki tokens mixprec evaluates on); its loss covers T positions per
row, mixprec's T - 1; it trains one step past its last evaluation. So each final model (nanoGPT's ckpt.pt
from that evaluation, mixprec's last checkpoint) is also scored on the same windows (the validation split's
first 64 Ki tokens, every position, fp32): the "same-windows val" column, the one to compare.

Per round (the order alternates each round), each tool's whole process: wall time (start-up, evaluations
and saving included), training time (its mean step time x steps: evaluations and the first step's warm-up
left out on both sides), training tokens/s and the final validation loss; medians over rounds, then ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mixprec.cli._common import VAL_FRACTION
from mixprec.cli._evaluation import EVAL_TOKENS
from mixprec.cli.train import DEFAULT_LR
from mixprec.data.corpus import load_corpus
from mixprec.models import GPT_PRESETS

WARMUP_RATIO = 0.05  # mixprec train's


@dataclass
class Run:
    tool: str
    wall_s: float
    train_s: float
    tokens_per_s: float
    val_loss: float
    """The tool's own estimate (its own windows of the validation split)."""
    shared_val_loss: float = float("nan")
    """Its final model on the same windows for both (:func:`shared_val_loss`), in fp32."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    p.add_argument("--data", default=None, help="corpus file (default: mixprec's embedded corpus)")
    p.add_argument("--model", default="small", choices=sorted(GPT_PRESETS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--precision", default="bf16", help="mixprec's --precision (default bf16)")
    p.add_argument("--fp32-ops", default="attention", help="mixprec's --fp32-ops ('' for none; default attention)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not (a.nanogpt / "train.py").is_file() or not (a.nanogpt / "configurator.py").is_file():
        p.error(f"--nanogpt {a.nanogpt}: no train.py and configurator.py there; pass a nanoGPT checkout")
    return a


def prepare(a: argparse.Namespace, work: Path) -> None:
    """mixprec's split of the corpus where nanoGPT's train.py looks for a dataset, and its configurator."""
    import numpy as np

    train, val = load_corpus(a.data).split(VAL_FRACTION)
    data = work / "data" / "mixprec"
    data.mkdir(parents=True, exist_ok=True)
    np.asarray(train.numpy(), dtype=np.uint16).tofile(data / "train.bin")
    np.asarray(val.numpy(), dtype=np.uint16).tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 256}, f)
    link = work / "configurator.py"
    if not link.exists():
        link.symlink_to((a.nanogpt / "configurator.py").resolve())


def nanogpt_argv(a: argparse.Namespace, work: Path) -> list[str]:
    shape = GPT_PRESETS[a.model]
    flags = {
        "dataset": "mixprec",
        "device": "cpu",
        "dtype": "float32",
        "compile": False,
        "out_dir": str(work / "out"),
        "batch_size": a.batch_size,
        "block_size": a.seq_len,
        "gradient_accumulation_steps": 1,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "n_embd": shape.n_embd,
        "bias": True,
        "dropout": 0.0,
        "learning_rate": float(a.lr),
        "min_lr": 0.0,
        "beta2": 0.99,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "warmup_iters": math.ceil(WARMUP_RATIO * a.steps),
        "lr_decay_iters": a.steps,
        "max_iters": a.steps,
        "eval_interval": a.steps,
        "eval_iters": max(1, EVAL_TOKENS // (a.batch_size * a.seq_len)),
        "log_interval": 1,
        "always_save_checkpoint": False,
    }
    return [sys.executable, str((a.nanogpt / "train.py").resolve()), *(f"--{k}={v}" for k, v in flags.items())]


def mixprec_argv(a: argparse.Namespace, out: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "mixprec.cli.main",
        "train",
        "--model",
        a.model,
        "--batch-size",
        str(a.batch_size),
        "--seq-len",
        str(a.seq_len),
        "--max-steps",
        str(a.steps),
        "--lr",
        str(a.lr),
        "--precision",
        a.precision,
        "--output-dir",
        str(out),
    ]
    if a.data:
        argv += ["--data", a.data]
    if a.fp32_ops:
        argv += ["--fp32-ops", a.fp32_ops]
    return argv


def run_nanogpt(a: argparse.Namespace, work: Path, env: dict[str, str]) -> Run:
    t0 = time.perf_counter()
    proc = subprocess.run(nanogpt_argv(a, work), cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"nanoGPT's train.py failed:\n{proc.stderr[-2000:]}")
    return parse_nanogpt(proc.stdout, a.steps, a.batch_size * a.seq_len, wall)


def parse_nanogpt(stdout: str, steps: int, tokens_per_step: int, wall: float) -> Run:
    """Its last "step N: ... val loss X" and the mean of its "iter k: ..., time T ms" lines, iterations 0 and N
    left out (they hold the evaluations and the first step's warm-up)."""
    val = float(re.findall(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)", stdout, re.M)[-1])
    iters = [(int(k), float(ms)) for k, ms in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", stdout, re.M)]
    step_s = statistics.fmean(ms for k, ms in iters if 0 < k < steps) / 1e3
    return Run("nanogpt", wall, step_s * steps, tokens_per_step / step_s, val)


def run_mixprec(a: argparse.Namespace, out: Path, env: dict[str, str]) -> Run:
    t0 = time.perf_counter()
    proc = subprocess.run(mixprec_argv(a, out), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"mixprec train failed:\n{proc.stderr[-2000:]}")
    return parse_mixprec(out / "metrics.jsonl", a.steps, a.batch_size * a.seq_len, wall)


def parse_mixprec(metrics: Path, steps: int, tokens_per_step: int, wall: float) -> Run:
    """Its last eval_loss and its mean step time from its first training-loss row (step 1) to its last, the
    evaluations in between left out: the same statistic as :func:`parse_nanogpt`'s, so neither side counts
    its first step's warm-up. (A median of nanoGPT's single steps against a median of mixprec's 10-step means
    favoured nanoGPT on a loaded machine: the median of single steps drops the slow tail a 10-step mean keeps.)
    A run with fewer than two such rows falls back to train_runtime less the evaluations, per step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_loss" in r]
    logged = [(r["step"], r["time"]) for r in rows if "loss" in r]
    if len(logged) >= 2 and logged[-1][0] > logged[0][0]:
        (s1, t1), (s2, t2) = logged[0], logged[-1]
        # an evaluation runs after its step's loss row: those of steps s1 .. s2 - 1 fall inside the span
        inside = sum(r.get("eval_runtime", 0.0) for r in evals if s1 <= r["step"] < s2)
        step_s = (t2 - t1 - inside) / (s2 - s1)
    else:
        runtime = next(r["train_runtime"] for r in reversed(rows) if "train_runtime" in r)
        step_s = (runtime - sum(r.get("eval_runtime", 0.0) for r in evals)) / steps
    return Run("mixprec", wall, step_s * steps, tokens_per_step / step_s, float(evals[-1]["eval_loss"]))


def shared_windows(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) over the validation split's first EVAL_TOKENS: consecutive windows of T + 1 tokens."""
    _, val = load_corpus(a.data).split(VAL_FRACTION)
    n = min(EVAL_TOKENS, len(val) - 1) // a.seq_len
    w = val[: n * a.seq_len + 1].long()
    x = torch.stack([w[i * a.seq_len : (i + 1) * a.seq_len] for i in range(n)])
    y = torch.stack([w[i * a.seq_len + 1 : (i + 1) * a.seq_len + 1] for i in range(n)])
    return x, y


@torch.no_grad()
def shared_val_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], windows: tuple[torch.Tensor, ...]) -> float:
    """Mean next-token cross-entropy over every position of the shared windows, fp32, batches of 16."""
    x, y = windows
    total = 0.0
    for i in range(0, len(x), 16):
        logits = logits_of(x[i : i + 16]).float()
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + 16].flatten(), reduction="sum").item()
    return total / y.numel()


def nanogpt_logits(a: argparse.Namespace, work: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """nanoGPT's model at its last evaluation (the ckpt.pt train.py saved there), from its own model.py."""
    from benchmarks.vs_nanogpt_gpu import load_nanogpt

    module = load_nanogpt(a.nanogpt / "model.py")
    ckpt = torch.load(work / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    model = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    return lambda x: model(x, x)[0]  # targets given: logits at every position, not only the last


def mixprec_logits(a: argparse.Namespace, out: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """mixprec's model at its last checkpoint (step ``--steps``)."""
    from safetensors.torch import load_file

    from mixprec.models import GPT

    model = GPT(GPT_PRESETS[a.model])
    result = model.load_state_dict(load_file(str(out / f"checkpoint-{a.steps}" / "model.safetensors")), strict=False)
    # the head is tied to the embedding and safetensors stores the shared tensor once
    if set(result.missing_keys) - {"lm_head.weight"} or result.unexpected_keys:
        raise RuntimeError(f"mixprec's checkpoint does not fit its GPT: {result}")
    model.eval()
    return lambda x: model(x).logits


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    with tempfile.TemporaryDirectory(prefix="vs_nanogpt-") as tmp:
        work = a.workdir or Path(tmp)
        prepare(a, work)
        windows = shared_windows(a)
        runs: list[Run] = []
        for r in range(a.rounds):
            order = ("nanogpt", "mixprec") if r % 2 == 0 else ("mixprec", "nanogpt")
            for tool in order:
                if tool == "nanogpt":
                    run = run_nanogpt(a, work, env)
                    run.shared_val_loss = shared_val_loss(nanogpt_logits(a, work), windows)
                else:
                    run = run_mixprec(a, work / f"mixprec-{r}", env)
                    run.shared_val_loss = shared_val_loss(mixprec_logits(a, work / f"mixprec-{r}"), windows)
                print(f"[vs_nanogpt] round {r + 1}: {run}", file=sys.stderr, flush=True)
                runs.append(run)
    med = {
        t: {
            f: statistics.median(getattr(x, f) for x in runs if x.tool == t)
            for f in Run.__dataclass_fields__
            if f != "tool"
        }
        for t in ("nanogpt", "mixprec")
    }
    mp, ng = med["mixprec"], med["nanogpt"]
    if a.json:
        print(json.dumps({"runs": [asdict(x) for x in runs], "median": med}, indent=1))
        return 0
    precision = a.precision + (f" --fp32-ops {a.fp32_ops}" if a.fp32_ops else "")
    print(
        f"{a.model} GPT, batch {a.batch_size} x {a.seq_len}, {a.steps} steps, {a.threads} threads, {a.rounds} "
        f"interleaved rounds (medians); mixprec --precision {precision}; nanoGPT fp32 (its CPU path)"
    )
    print(f"{'':<10}{'wall s':>9}{'train s':>9}{'tokens/s':>10}{'own val':>10}{'same-windows val':>18}")
    for tool, m in med.items():
        print(
            f"{tool:<10}{m['wall_s']:>9.1f}{m['train_s']:>9.1f}{m['tokens_per_s']:>10,.0f}{m['val_loss']:>10.4f}"
            f"{m['shared_val_loss']:>18.4f}"
        )
    ratio = {f: mp[f] / ng[f] for f in mp}
    print(
        f"mixprec / nanoGPT: wall {ratio['wall_s']:.2f}x, train time {ratio['train_s']:.2f}x, "
        f"tokens/s {ratio['tokens_per_s']:.2f}x, "
        f"same-windows val loss {ratio['shared_val_loss'] - 1:+.2%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
