"""NEFTune (``TrainingArguments(neftune_noise_alpha=...)``): bounded uniform noise on the input embeddings
while training, none in evaluation, and the model left without the hook after ``train()``."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import GPT, GPTConfig, Trainer, TrainingArguments
from mixprec.trainer.neftune import neftune
from trainer_utils import SEQ, VOCAB, flat_params, make_examples, make_model


class EmbeddedLM(torch.nn.Module):
    """trainer_utils' model with HF's get_input_embeddings()."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.inner = make_model(dropout=0.0, **kwargs)
        self.forward = self.inner.forward

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.embed


def args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(
        str(tmp_path / "out"),
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        max_steps=4,
        learning_rate=1e-2,
        **kwargs,
    )


def test_noise_is_uniform_within_alpha_over_sqrt_length_times_width_in_training_only():
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32))
    embed = model.get_input_embeddings()
    ids = torch.randint(0, 64, (4, 32))
    clean = embed(ids)
    alpha, bound = 5.0, 5.0 / math.sqrt(32 * 32)
    with neftune(model, alpha):
        model.train()
        first, second = embed(ids) - clean, embed(ids) - clean
        assert not torch.equal(first, second)  # fresh noise every forward
        assert first.abs().max() <= bound and first.abs().max() > 0.9 * bound  # fills [-bound, bound]
        assert abs(first.mean().item()) < 0.05 * bound  # centred
        model.eval()
        assert torch.equal(embed(ids), clean)  # evaluation sees clean embeddings
    model.train()
    assert torch.equal(embed(ids), clean) and not embed._forward_hooks  # the hook is gone


def test_trainer_trains_with_the_noise_and_removes_it_afterwards(tmp_path):
    data = make_examples(32)
    plain = EmbeddedLM()
    Trainer(plain, args(tmp_path / "plain"), train_dataset=data).train()
    noisy = EmbeddedLM()
    trainer = Trainer(noisy, args(tmp_path / "noisy", neftune_noise_alpha=15.0), train_dataset=data)
    trainer.train()
    assert not noisy.get_input_embeddings()._forward_hooks
    differs = [k for k, v in flat_params(plain).items() if not torch.equal(v, flat_params(noisy)[k])]
    assert differs  # the noise changed what was trained
    ids = torch.randint(0, VOCAB, (2, SEQ))
    noisy.eval()
    assert torch.equal(noisy(ids).logits, noisy(ids).logits)


def test_the_hook_is_removed_when_training_fails(tmp_path):
    class Fails(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise RuntimeError("planted")

    model = EmbeddedLM()
    with pytest.raises(RuntimeError, match="planted"):
        Fails(model, args(tmp_path, neftune_noise_alpha=5.0), train_dataset=make_examples(8)).train()
    assert not model.get_input_embeddings()._forward_hooks


def test_a_model_without_input_embeddings_or_a_bad_alpha_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"neftune_noise_alpha.*get_input_embeddings"):
        Trainer(make_model(), args(tmp_path, neftune_noise_alpha=5.0), train_dataset=make_examples(8))
    with pytest.raises(ValueError, match=r"TrainingArguments\(neftune_noise_alpha=-1"):
        TrainingArguments(neftune_noise_alpha=-1.0)
