"""benchmarks/vs_nanogpt_gpu.py on the CPU: the whole path with a tiny stand-in for nanoGPT's model.py (written
into tmp_path with nanoGPT's interface: ``GPTConfig``, ``GPT(config)``, ``forward(idx, targets) -> (logits,
loss)``), so the script a GPU session runs is known to work before the GPU is lent."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import vs_nanogpt_gpu

STAND_IN = """
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 300
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.mix = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits = self.lm_head(torch.relu(self.mix(self.wte(idx))))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss
"""


def test_every_variant_runs_side_by_side_on_the_cpu(tmp_path, monkeypatch):
    from mixprec.bench import peak

    monkeypatch.setattr(peak, "_MAX_SIZE", {"cuda": 8192, "cpu": 256})  # a quick peak measurement
    (tmp_path / "nanogpt").mkdir()
    (tmp_path / "nanogpt" / "model.py").write_text(STAND_IN)
    out = tmp_path / "vs.json"
    argv = [
        "--nanogpt",
        str(tmp_path / "nanogpt"),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--no-compile",
        "--loss-chunk",
        "7",
        "--variants",
        ",".join(vs_nanogpt_gpu.VARIANTS),
        "--json",
        str(out),
    ]
    assert vs_nanogpt_gpu.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == list(vs_nanogpt_gpu.VARIANTS)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and math.isfinite(r["final_loss"]), r
    # random ids over 300 words: every model starts near ln(300) = 5.7
    assert all(4.5 < r["final_loss"] < 7.0 for r in rows)


def test_a_folder_without_model_py_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        vs_nanogpt_gpu.parse_args(["--nanogpt", str(tmp_path)])
    assert "--nanogpt" in capsys.readouterr().err
