"""The built-in GPT: shapes, causality, the HF-style output, precision under autocast, presets, generation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree

from mixprec.models import GPT, GPT_PRESETS, CausalLMOutput, GPTConfig

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def random_ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq), generator=g)


# --- config and presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(n_embd=30, n_head=4), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(n_head=-1), "n_head"),
        (dict(block_size=0), "block_size"),
        (dict(vocab_size=2.5), "vocab_size"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_config_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{**TINY, **bad})


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'.*tiny, small, gpt2"):
        GPT.from_preset("huge")


def test_preset_overrides_apply_and_unknown_fields_are_refused():
    model = GPT.from_preset("tiny", dropout=0.1, n_layer=1)
    assert model.config.dropout == 0.1 and model.config.n_layer == 1
    assert model.config.n_embd == GPT_PRESETS["tiny"].n_embd
    assert GPT_PRESETS["tiny"].n_layer == 2  # the preset itself is not mutated
    with pytest.raises(ValueError, match="n_layers"):
        GPT.from_preset("tiny", n_layers=3)


def test_gpt2_preset_has_the_124m_shape():
    # meta device: the shape without allocating or initialising 124M parameters
    with torch.device("meta"):
        model = GPT.from_preset("gpt2")
    # nanoGPT reports 124.44M for GPT-2 small with the 50257 vocabulary and tied embeddings
    assert model.num_parameters() == 124_439_808
    assert model.num_parameters(exclude_position_embeddings=True) == 124_439_808 - 1024 * 768


def test_the_1b_preset_is_near_a_billion_parameters():
    with torch.device("meta"):
        model = GPT.from_preset("gpt-1b")
    assert 0.9e9 < model.num_parameters() < 0.92e9  # 16 x 12 x 2048^2 in the blocks + 50257 x 2048 tied


def test_weights_are_tied_and_counted_once():
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_parameters() == sum(unique.values())
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert untied - model.num_parameters() == 256 * 32


def test_flops_per_token_is_6n_plus_attention():
    model = tiny_model()
    n = model.num_parameters(exclude_position_embeddings=True)
    assert model.estimate_flops_per_token() == 6 * n + 12 * 2 * 32 * 32
    assert model.estimate_flops_per_token(seq_len=8) == 6 * n + 12 * 2 * 32 * 8


def test_residual_projections_use_the_scaled_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=8, n_head=4, n_embd=256))
    proj = model.transformer.h[0].mlp.c_proj.weight
    fc = model.transformer.h[0].mlp.c_fc.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)


# --- forward ----------------------------------------------------------------------------------------------


def test_output_shapes_and_hf_style_access():
    model = tiny_model()
    ids = random_ids()
    out = model(ids, labels=ids)
    assert isinstance(out, CausalLMOutput)
    assert out.logits.shape == (2, 16, 256)
    assert out.loss.shape == ()
    assert out["loss"] is out.loss and out[0] is out.loss and out[1] is out.logits
    assert out.keys() == ["loss", "logits"]
    loss, logits = out  # tuple-style unpacking yields the values
    assert loss is out.loss and logits is out.logits

    no_labels = model(ids)
    assert no_labels.loss is None
    assert no_labels[0] is no_labels.logits  # None fields drop out, as in transformers
    assert "loss" not in no_labels
    with pytest.raises(KeyError):
        no_labels["loss"]


def test_output_is_a_pytree_so_ddp_sees_its_tensors():
    ids = random_ids()
    out = tiny_model()(ids, labels=ids)
    leaves, spec = pytree.tree_flatten(out)
    assert any(leaf is out.loss for leaf in leaves) and any(leaf is out.logits for leaf in leaves)
    assert isinstance(pytree.tree_unflatten(leaves, spec), CausalLMOutput)


def test_loss_at_init_is_about_ln_vocab():
    model = tiny_model()
    ids = random_ids(batch=4, seq=32)
    loss = model(ids, labels=ids).loss.item()
    assert loss == pytest.approx(math.log(256), abs=0.1)


def test_loss_shifts_labels_and_ignores_minus_100():
    model = tiny_model()
    ids = random_ids()
    labels = ids.clone()
    labels[:, 5:] = -100
    out = model(ids, labels=labels)
    # position t predicts token t+1: only targets 1..4 count
    expected = torch.nn.functional.cross_entropy(out.logits[:, :4].reshape(-1, 256).float(), ids[:, 1:5].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


def test_causality_future_tokens_do_not_change_past_logits():
    model = tiny_model()
    ids = random_ids(batch=1, seq=16)
    changed = ids.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_attention_mask_hides_padding_keys_and_left_padding_is_not_nan():
    model = tiny_model()
    ids = random_ids(batch=1, seq=12)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=ids.dtype)], dim=1)
    mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 4)], dim=1).long()
    # right padding: the real positions see exactly what they see unpadded
    torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, :12], model(ids).logits, atol=1e-5, rtol=0)
    # a key masked out changes nothing for later queries, even though it precedes them
    ids2 = ids.clone()
    ids2[0, 3] = (ids2[0, 3] + 7) % 256
    hole = torch.ones(1, 12, dtype=torch.long)
    hole[0, 3] = 0
    torch.testing.assert_close(
        model(ids, attention_mask=hole).logits[:, 4:], model(ids2, attention_mask=hole).logits[:, 4:], atol=1e-5, rtol=0
    )
    # left padding: the fully padded query rows must not turn into NaN (they would poison the gradients)
    left = torch.flip(mask, dims=[1])
    labels = torch.flip(padded, dims=[1]).masked_fill(left == 0, -100)
    out = model(torch.flip(padded, dims=[1]), labels=labels, attention_mask=left)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_sequence_longer_than_block_size_is_refused_with_the_fix():
    model = GPT(GPTConfig(**{**TINY, "block_size": 256}))
    with pytest.raises(ValueError) as info:
        model(torch.zeros(1, 300, dtype=torch.long))
    assert str(info.value) == (
        "sequence length 300 exceeds the model's block_size 256; use --seq-len <= 256 or a larger model"
    )


def test_input_ids_dtype_handling():
    model = tiny_model()
    ids = random_ids()
    # uint8 ids straight from the byte corpus are accepted and mean the same tokens
    torch.testing.assert_close(model(ids.to(torch.uint8)).logits, model(ids).logits)
    with pytest.raises(ValueError, match="integer token ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(ids, labels=ids[:, :-1])


def test_a_few_adamw_steps_on_a_repeated_corpus_make_the_loss_fall():
    model = tiny_model()
    text = torch.tensor(list(b"def add(a, b):\n    return a + b\n" * 8))
    ids = text[: 4 * 32].view(4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


# --- precision under autocast ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_autocast_runs_linears_in_low_precision_and_keeps_the_loss_fp32(dtype):
    model = tiny_model()
    seen = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    ids = random_ids()
    with torch.autocast("cpu", dtype=dtype):
        out = model(ids, labels=ids)
    for h in hooks:
        h.remove()
    assert seen and set(seen) == {dtype}  # every matmul really ran in the low precision
    assert out.logits.dtype == dtype
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    # and it is the same loss as fp32, within what the low precision allows
    assert out.loss.item() == pytest.approx(model(ids, labels=ids).loss.item(), abs=0.05)
    out.loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_low_precision_logits_fp32_loss(dtype):
    model = tiny_model().cuda()
    ids = random_ids().cuda()
    with torch.autocast("cuda", dtype=dtype):
        out = model(ids, labels=ids)
    assert out.logits.dtype == dtype
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


# --- generation -----------------------------------------------------------------------------------------


def test_generate_appends_tokens_and_crops_to_block_size():
    model = tiny_model()
    model.train()
    prompt = random_ids(batch=2, seq=5)
    out = model.generate(prompt, max_new_tokens=40, top_k=10)  # runs past block_size=32
    assert out.shape == (2, 45) and out.dtype == prompt.dtype
    assert torch.equal(out[:, :5], prompt)
    assert ((out >= 0) & (out < 256)).all()
    assert model.training  # the mode is restored
    assert model.generate(prompt, max_new_tokens=0).shape == (2, 5)


def test_generate_is_reproducible_with_a_generator_and_greedy_is_deterministic():
    model = tiny_model()
    prompt = random_ids(batch=1, seq=4)
    a = model.generate(prompt, 12, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 12, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    g1 = model.generate(prompt, 6, temperature=0)
    expected = prompt
    for _ in range(6):  # greedy is the argmax of the full forward, step by step
        expected = torch.cat([expected, model(expected).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(g1, expected)


def test_generate_rejects_bad_arguments():
    model = tiny_model()
    prompt = random_ids(batch=1, seq=4)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)


def test_num_parameters_takes_hf_keywords():
    # the HF Trainer calls model.num_parameters(only_trainable=..., exclude_embeddings=True)
    model = GPT.from_preset("tiny")
    total = model.num_parameters()
    wte, wpe = model.transformer.wte.weight.numel(), model.transformer.wpe.weight.numel()
    assert model.num_parameters(exclude_embeddings=True) == total - wte - wpe
    assert model.num_parameters(only_trainable=True) == total
    model.transformer.wpe.weight.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) == total - wpe
