"""precision/fp8_layers.py: which Linear layers fp8 converts (issue 28: fp8 lost to bf16 on GPT-2 124M). Pure
shape logic, checked on the meta device at the GPU benchmark's two sizes; no torchao needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.models import GPT, GPTConfig
from mixprec.precision.fp8_layers import Fp8LayerFilter, embedding_weight_ids

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=1, n_head=12, n_embd=768)
GPT_1B = GPTConfig(vocab_size=50257, block_size=1024, n_layer=1, n_head=16, n_embd=2048)
BLOCK = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]


def _decisions(config: GPTConfig, layer_filter: Fp8LayerFilter) -> dict[str, str]:
    with torch.device("meta"):
        model = GPT(config)
    embeddings = embedding_weight_ids(model)
    return {
        name.removeprefix("transformer.h.0."): layer_filter.why_not(name, m, embeddings)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }


def test_on_gpt2_tensorwise_converts_the_two_wide_layers_and_leaves_the_small_and_the_head():
    why = _decisions(GPT2, Fp8LayerFilter("tensorwise"))
    assert [n for n in BLOCK if not why[n]] == ["attn.c_attn", "mlp.c_fc"]  # 768 -> 2304, 768 -> 3072
    assert "too small" in why["attn.c_proj"] and "too small" in why["mlp.c_proj"]
    assert "divisible by 16" in why["lm_head"]  # 50257 words


def test_a_padded_head_is_still_left_in_bf16_as_the_head():
    why = _decisions(GPTConfig(**{**GPT2.__dict__, "vocab_multiple": 64}), Fp8LayerFilter())
    assert "output head" in why["lm_head"]  # 50304 is aligned, but the head is tied to the embedding


def test_at_a_billion_parameters_tensorwise_converts_every_block_layer_and_rowwise_the_wide_ones():
    assert all(w == "" for n, w in _decisions(GPT_1B, Fp8LayerFilter("tensorwise")).items() if n in BLOCK)
    rowwise = _decisions(GPT_1B, Fp8LayerFilter("rowwise"))  # its thresholds leave N <= 2048 out
    assert [n for n in BLOCK if not rowwise[n]] == ["attn.c_attn", "mlp.c_fc"]


def test_rowwise_leaves_all_of_gpt2_in_bf16_and_skip_small_off_converts_every_aligned_layer():
    assert all("too small" in _decisions(GPT2, Fp8LayerFilter("rowwise"))[n] for n in BLOCK)
    everything = _decisions(GPT2, Fp8LayerFilter(skip_small=False))
    assert all(everything[n] == "" for n in BLOCK)


def test_the_head_by_name_and_the_root_and_bad_recipes():
    head = nn.Linear(4096, 4096)
    assert "output head" in Fp8LayerFilter().why_not("output", head)  # torchtitan's name, untied
    assert Fp8LayerFilter(skip_head=False).why_not("output", head) == ""
    assert "the model itself" in Fp8LayerFilter().why_not("", head)
    with pytest.raises(ValueError, match="recipe"):
        Fp8LayerFilter("blockwise")
