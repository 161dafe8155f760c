"""models/chunked_loss.py and the GPT options built on it (loss_chunk_size, vocab_multiple): the same loss and
gradients as F.cross_entropy over full logits, within stated tolerances.

Tolerances. fp32: the chunked sums are reordered, nothing else: 1e-5 relative. bf16 autocast: both paths run the
matmuls in bf16 and the softmax in fp32; the plain path rounds the head's weight gradient once to bf16 (unit
roundoff 2^-9 ~ 2e-3), the chunked one accumulates it in fp32, so gradients agree to 1e-2 of their largest entry
and the loss to 1e-3 relative.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.models import GPT, GPTConfig
from mixprec.models.chunked_loss import linear_cross_entropy

TOKENS, WIDTH, VOCAB = 37, 16, 50  # 37 tokens: the last chunk is a partial one


def _inputs(rows: int = VOCAB, ignored: int = 5):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, generator=g, requires_grad=True)
    weight = (torch.randn(rows, WIDTH, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[:ignored] = -100
    return hidden, weight, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def _reference(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight[:VOCAB].t()).float(), labels, ignore_index=-100)


def _close(a, b, rel):
    return (a.float() - b.float()).abs().max() <= rel * b.float().abs().max()


@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_fp32_loss_and_gradients_match_cross_entropy_over_full_logits(chunk):
    hidden, weight, labels = _inputs()
    want = _reference(hidden, weight, labels)
    got = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    assert math.isclose(got.item(), want.item(), rel_tol=1e-5)
    for g, w in zip(_grads(got * 3, hidden, weight), _grads(want * 3, hidden, weight)):  # an upstream gradient
        assert _close(g, w, 1e-5)


def test_bf16_autocast_matches_within_bf16_rounding():
    hidden, weight, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(hidden, weight, labels)
        got = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert got.dtype == torch.float32 and math.isclose(got.item(), want.item(), rel_tol=1e-3)
    for g, w in zip(_grads(got, hidden, weight), _grads(want, hidden, weight)):
        assert g.dtype == w.dtype and _close(g, w, 1e-2)


def test_padded_rows_get_no_probability_and_no_gradient():
    hidden, weight, labels = _inputs(rows=64)
    got = linear_cross_entropy(hidden, weight, labels, chunk_size=8, vocab_size=VOCAB)
    want = _reference(hidden, weight, labels)
    assert math.isclose(got.item(), want.item(), rel_tol=1e-5)
    grad_w = _grads(got, weight)[0]
    assert torch.count_nonzero(grad_w[VOCAB:]) == 0 and _close(grad_w, _grads(want, weight)[0], 1e-5)


def test_without_gradients_it_only_computes_the_loss_and_every_label_ignored_is_nan():
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert math.isclose(loss.item(), _reference(hidden, weight, labels).item(), rel_tol=1e-5)
    assert math.isnan(linear_cross_entropy(hidden, weight, torch.full_like(labels, -100), chunk_size=8).item())
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def _gpt(**options) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False, **options))


def test_gpt_with_a_chunked_loss_trains_as_the_plain_one():
    ids = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    plain, chunked = _gpt(), _gpt(loss_chunk_size=7)
    a, b = plain(ids, labels=ids), chunked(ids, labels=ids)
    assert b.logits is None and math.isclose(a.loss.item(), b.loss.item(), rel_tol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert _close(q.grad, p.grad, 1e-5), name
    chunked.eval()  # evaluation keeps the logits (metrics, generation)
    assert chunked(ids, labels=ids).logits.shape == (3, 16, 50)


def test_a_padded_vocabulary_is_the_same_model_with_aligned_shapes():
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, padded = _gpt(), _gpt(vocab_multiple=64)
    assert padded.lm_head.weight.shape == (64, 16) and padded.config.padded_vocab_size == 64
    with torch.no_grad():
        padded.load_state_dict(
            {k: v for k, v in plain.state_dict().items() if "wte" not in k and "lm_head" not in k}, strict=False
        )
        padded.transformer.wte.weight[:50] = plain.transformer.wte.weight
    a, b = plain(ids, labels=ids), padded(ids, labels=ids)
    assert b.logits.shape == (2, 16, 50) and math.isclose(a.loss.item(), b.loss.item(), rel_tol=1e-6)
    assert padded.generate(ids[:, :4], 3, temperature=1.0).max() < 50  # never a padded id
    with pytest.raises(ValueError, match="vocab_multiple"):
        GPTConfig(vocab_multiple=0)


@pytest.mark.gpu
def test_on_cuda_under_bf16_and_compile_the_chunked_gpt_matches_the_plain_one():
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
    plain, chunked = _gpt().cuda(), _gpt(loss_chunk_size=16, vocab_multiple=64).cuda()
    with torch.no_grad():  # the same weights: the padded head's real rows are the plain head
        for p, q in zip(plain.parameters(), chunked.parameters()):
            q[: p.shape[0]].copy_(p)
    compiled = torch.compile(chunked)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = plain(ids, labels=ids).loss, compiled(ids, labels=ids).loss
    assert math.isclose(a.item(), b.item(), rel_tol=1e-3)
    a.backward()
    b.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert _close(q.grad[: p.shape[0]], p.grad, 1e-2), name


def test_z_loss_with_the_chunked_loss_is_refused_not_dropped():
    """The chunked path never holds the logits the z-loss needs: asking for both is an error naming the fix."""
    with pytest.raises(ValueError, match="loss_chunk_size=None"):
        GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, n_embd=8, z_loss=1e-4, loss_chunk_size=16)
