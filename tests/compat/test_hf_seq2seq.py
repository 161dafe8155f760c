"""HF's Seq2SeqTrainer contract (run_summarization.py / run_translation.py: predict_with_generate,
generation_max_length / generation_num_beams, max_length / num_beams at evaluate and predict), checked
against mixprec's or transformers' (our own code, from reading trainer_seq2seq.py and its tests):

    PYTHONPATH=src:. pytest -q tests/compat/test_hf_seq2seq.py                                   # mixprec
    MIXPREC_COMPAT_IMPL=transformers PYTHONPATH=src:. pytest -q tests/compat/test_hf_seq2seq.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL == "transformers":
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
else:
    from mixprec import Seq2SeqTrainer, Seq2SeqTrainingArguments

PAD, EOS, VOCAB = 0, 1, 24


def copy_task(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(2, VOCAB, (3 + i % 3,), generator=g)
        seq = torch.cat([ids, torch.tensor([EOS])])
        rows.append({"input_ids": seq, "attention_mask": torch.ones_like(seq), "labels": seq.clone()})
    return rows


def pad_collate(features):
    longest = max(len(f["input_ids"]) for f in features)

    def pad(key, value):
        return torch.stack([torch.nn.functional.pad(f[key], (0, longest - len(f[key])), value=value) for f in features])

    ids, mask = pad("input_ids", PAD), pad("attention_mask", 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": pad("labels", -100)}


def tiny_t5():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        decoder_start_token_id=PAD,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    return transformers.T5ForConditionalGeneration(config)


def trainer_for(tmp_path, compute_metrics=None, **kwargs):
    extra = {"save_plots": False} if IMPL == "mixprec" else {}
    args = Seq2SeqTrainingArguments(
        str(tmp_path / "out"),
        report_to="none",
        disable_tqdm=True,
        max_steps=4,
        per_device_eval_batch_size=4,
        save_strategy="no",
        **extra,
        **kwargs,
    )
    return Seq2SeqTrainer(
        tiny_t5(),
        args,
        train_dataset=copy_task(16, 0),
        eval_dataset=copy_task(6, 1),
        data_collator=pad_collate,
        compute_metrics=compute_metrics,
    )


@pytest.mark.parametrize("precision", [{}, {"bf16": True, "use_cpu": True}], ids=["fp32", "bf16"])
def test_predict_with_generate_hands_compute_metrics_generated_tokens(tmp_path, precision):
    seen = {}

    def metrics(pred):
        seen["predictions"], seen["labels"] = pred.predictions, pred.label_ids
        return {"length": float(np.mean([(row != -100).sum() for row in pred.predictions]))}

    trainer = trainer_for(tmp_path, metrics, predict_with_generate=True, generation_max_length=5, **precision)
    trainer.train()
    result = trainer.evaluate()
    assert "eval_loss" in result and "eval_length" in result
    preds = seen["predictions"]
    assert preds.shape[0] == 6 and np.issubdtype(preds.dtype, np.integer)
    assert ((preds == -100) | ((preds >= 0) & (preds < VOCAB))).all()  # token ids (-100: padding across batches)

    def generated(p):  # tokens per row beyond padding (HF pads to the model's max_length, mixprec across batches)
        return ((p != -100) & (p != PAD)).sum(axis=1).max()

    assert generated(preds) <= 5  # generation_max_length, the start token (PAD) included in it
    out = trainer.predict(copy_task(6, 2), max_length=3)  # a call's max_length wins over the argument's
    assert generated(out.predictions) <= 3 and out.label_ids.shape[0] == 6


def test_without_generate_the_predictions_are_logits(tmp_path):
    trainer = trainer_for(tmp_path)
    out = trainer.predict(copy_task(6, 2))
    logits = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions
    assert logits.ndim == 3 and logits.shape[-1] == VOCAB and np.issubdtype(logits.dtype, np.floating)
