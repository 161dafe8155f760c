"""HF's Seq2SeqTrainer contract (run_summarization.py / run_translation.py: predict_with_generate,
generation_max_length / generation_num_beams, max_length / num_beams at evaluate and predict), checked
against mixprec's or transformers' (our own code, from reading trainer_seq2seq.py and its tests):

    PYTHONPATH=src:. pytest -q tests/compat/test_hf_seq2seq.py                                   # mixprec
    MIXPREC_COMPAT_IMPL=transformers PYTHONPATH=src:. pytest -q tests/compat/test_hf_seq2seq.py
"""

from __future__ import annotations

import json
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

    fill = {"attention_mask": 0, "labels": -100}
    return {key: pad(key, fill.get(key, PAD)) for key in features[0]}


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
        **{"save_strategy": "no", **extra, **kwargs},
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


@pytest.fixture
def generate_calls(monkeypatch):
    """The keywords each ``generate`` call of the tiny T5 got."""
    calls = []
    generate = transformers.T5ForConditionalGeneration.generate

    def recording(self, *args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k in ("max_length", "max_new_tokens", "num_beams")})
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.T5ForConditionalGeneration, "generate", recording)
    return calls


def test_a_none_given_to_predict_takes_the_arguments_generation_settings(tmp_path, generate_calls):
    """Scripts pass ``max_length=data_args.val_max_target_length``, often None: the arguments' values hold."""
    trainer = trainer_for(tmp_path, predict_with_generate=True, generation_max_length=4, generation_num_beams=2)
    trainer.predict(copy_task(4, 2), max_length=None, num_beams=None)
    assert generate_calls and all(call == {"max_length": 4, "num_beams": 2} for call in generate_calls)


def test_max_new_tokens_keeps_generation_max_length_out(tmp_path, generate_calls):
    trainer = trainer_for(tmp_path, predict_with_generate=True, generation_max_length=4)
    trainer.predict(copy_task(4, 2), max_new_tokens=2)
    assert generate_calls and all(call == {"max_new_tokens": 2} for call in generate_calls)


@pytest.mark.parametrize("given", ["object", "folder", "file"])
def test_a_generation_config_is_used_and_saved_with_the_checkpoints(tmp_path, given):
    """A GenerationConfig, or the folder or file it was saved to, reaches the model, and the arguments still
    save as JSON at each checkpoint (the object once made the first save fail: the run lost its steps)."""
    config = transformers.GenerationConfig(max_length=3, num_beams=2, decoder_start_token_id=PAD)
    config.save_pretrained(tmp_path / "gen", config_file_name="summarize.json" if given == "file" else None)
    value = {"object": config, "folder": str(tmp_path / "gen"), "file": str(tmp_path / "gen" / "summarize.json")}
    trainer = trainer_for(tmp_path, generation_config=value[given], save_strategy="steps", save_steps=2)
    trainer.train()
    model_config = trainer.model.generation_config
    assert (model_config.max_length, model_config.num_beams) == (3, 2)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert json.loads(trainer.args.to_json_string())["generation_config"] is not None


def test_predicting_unlabelled_data_hands_compute_metrics_nothing(tmp_path):
    """As HF: without labels there are predictions and no metrics (a script's metric reads the labels)."""

    def metrics(pred):
        raise AssertionError(f"compute_metrics called with label_ids={pred.label_ids}")

    trainer = trainer_for(tmp_path, metrics)
    # the decoder's inputs given, as labels would have made them (T5 cannot run without either)
    start = torch.tensor([PAD])
    unlabelled = [
        {
            "input_ids": r["input_ids"],
            "attention_mask": r["attention_mask"],
            "decoder_input_ids": torch.cat([start, r["labels"][:-1]]),
        }
        for r in copy_task(4, 2)
    ]
    out = trainer.predict(unlabelled)
    assert out.label_ids is None and out.predictions is not None
    speed = {"test_runtime", "test_samples_per_second", "test_steps_per_second", "test_model_preparation_time"}
    assert set(out.metrics) <= speed


def test_a_tokenizer_as_processing_class_pads_the_batches(tmp_path):
    """As HF: with no data_collator, a tokenizer given as processing_class pads each batch (inputs of
    different lengths; the targets here are of one length, as DataCollatorWithPadding leaves labels alone)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": PAD, "</s>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w2"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    rows = [{"input_ids": r["input_ids"].tolist(), "labels": r["labels"][:3].tolist()} for r in copy_task(8, 0)]
    extra = {"save_plots": False} if IMPL == "mixprec" else {}
    args = Seq2SeqTrainingArguments(
        str(tmp_path / "out"), report_to="none", disable_tqdm=True, max_steps=2, save_strategy="no", **extra
    )
    trainer = Seq2SeqTrainer(tiny_t5(), args, train_dataset=rows, eval_dataset=rows, processing_class=tokenizer)
    trainer.train()
    assert np.isfinite(trainer.evaluate()["eval_loss"])
