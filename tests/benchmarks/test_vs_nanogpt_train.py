"""benchmarks/vs_nanogpt.py: nanoGPT reads mixprec's own split, both get the same recipe, and the two logs are
read the same way (mean step time without the evaluations, last validation loss). The end-to-end run needs a
nanoGPT checkout and is a benchmark, not a test."""

from __future__ import annotations

import argparse
import json
import pickle

import numpy as np

from benchmarks import vs_nanogpt
from mixprec.data.corpus import load_corpus


def _args(tmp_path, **kw):
    checkout = tmp_path / "nanoGPT"
    checkout.mkdir(exist_ok=True)
    (checkout / "configurator.py").write_text("# nanoGPT's\n")
    base = dict(
        nanogpt=checkout,
        data=None,
        model="small",
        batch_size=16,
        seq_len=128,
        steps=300,
        lr=3e-3,
        precision="bf16",
        fp32_ops="attention",
        threads=2,
    )
    return argparse.Namespace(**{**base, **kw})


def test_nanogpt_reads_the_bytes_mixprec_trains_and_evaluates_on(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    a = _args(tmp_path, data=str(corpus))
    work = tmp_path / "work"
    vs_nanogpt.prepare(a, work)
    train, val = load_corpus(str(corpus)).split(0.1)
    assert np.fromfile(work / "data/mixprec/train.bin", dtype=np.uint16).tolist() == train.tolist()
    assert np.fromfile(work / "data/mixprec/val.bin", dtype=np.uint16).tolist() == val.tolist()
    assert pickle.loads((work / "data/mixprec/meta.pkl").read_bytes()) == {"vocab_size": 256}
    assert (work / "configurator.py").resolve() == (a.nanogpt / "configurator.py").resolve()  # linked, not copied


def test_both_get_the_same_shape_and_recipe(tmp_path):
    a = _args(tmp_path)
    flags = dict(f[2:].split("=", 1) for f in vs_nanogpt.nanogpt_argv(a, tmp_path)[2:])
    assert (flags["n_layer"], flags["n_head"], flags["n_embd"]) == ("4", "4", "128")  # the "small" preset
    assert (flags["batch_size"], flags["block_size"], flags["max_iters"]) == ("16", "128", "300")
    assert flags["warmup_iters"] == "15" and flags["min_lr"] == "0.0" and flags["beta2"] == "0.99"
    assert flags["eval_iters"] == "32"  # 64 Ki tokens, as mixprec train evaluates on
    mp = vs_nanogpt.mixprec_argv(a, tmp_path / "out")
    assert mp[mp.index("--max-steps") + 1] == "300" and mp[mp.index("--fp32-ops") + 1] == "attention"


def test_nanogpt_s_log_is_read_as_a_mean_step_without_the_evaluating_iterations():
    lines = ["step 0: train loss 5.5000, val loss 5.5100"]
    lines += ["iter 0: loss 5.5000, time 900.00ms, mfu -100.00%"]
    # a slow step counts in full (a median would drop it, and mixprec's side is a total): mean 110 ms, median 100
    lines += [f"iter {k}: loss 3.0000, time {ms:.2f}ms, mfu 1.00%" for k, ms in ((1, 100), (2, 100), (3, 130))]
    lines += ["step 4: train loss 2.9000, val loss 2.9500", "iter 4: loss 2.9, time 800.00ms, mfu 1.00%"]
    run = vs_nanogpt.parse_nanogpt("\n".join(lines), steps=4, tokens_per_step=2048, wall=9.0)
    assert run.val_loss == 2.95
    assert abs(run.train_s - 0.110 * 4) < 1e-9 and abs(run.tokens_per_s - 2048 / 0.110) < 1e-6


def test_mixprec_s_log_is_read_the_same_way(tmp_path):
    rows = [{"time": 0.0, "event": "train_begin", "step": 0}, {"time": 10.0, "step": 1, "loss": 5.0}]
    # an evaluation after step 11's row (5 s) falls inside the span and is left out; the one after the last row
    # (step 31) is outside it
    rows += [{"time": 12.0, "step": 11, "loss": 3.0}, {"time": 17.0, "step": 11, "eval_loss": 3.1, "eval_runtime": 5.0}]
    # steps 22-31 ran slowly (0.5 s each): they count in full, as on nanoGPT's side
    rows += [{"time": 19.0, "step": 21, "loss": 3.0}, {"time": 24.0, "step": 31, "loss": 3.0}]
    rows += [{"time": 54.0, "step": 31, "eval_loss": 2.97, "eval_runtime": 30.0}, {"time": 54.0, "train_runtime": 54.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run = vs_nanogpt.parse_mixprec(tmp_path / "metrics.jsonl", steps=31, tokens_per_step=2048, wall=45.0)
    assert run.val_loss == 2.97
    # (24 - 10 - 5) s over steps 2..31; the first step's 10 s warm-up is not a step time
    assert abs(run.train_s / 31 - 0.3) < 1e-9


def test_both_models_are_scored_on_the_same_next_token_windows(tmp_path):
    import math

    import torch

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)
    a = _args(tmp_path, data=str(corpus), seq_len=16)
    x, y = vs_nanogpt.shared_windows(a)
    _, val = load_corpus(str(corpus)).split(0.1)
    assert len(val) == 1024 and x.shape == y.shape == (63, 16)  # windows of 17 tokens inside the 1,024
    assert torch.equal(x.flatten()[1:], y.flatten()[:-1]) and x[0, 0].item() == val[0].item()
    uniform = vs_nanogpt.shared_val_loss(lambda xb: torch.zeros(*xb.shape, 256), (x, y))
    assert abs(uniform - math.log(256)) < 1e-5  # every position counted once, mean over tokens
