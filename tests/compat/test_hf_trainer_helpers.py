"""transformers' own pieces used with mixprec's Trainer (issue 22): a script that swapped only
``Trainer``/``TrainingArguments`` keeps its ``TrainerCallback`` subclasses, transformers' ``EarlyStoppingCallback``,
its ``DataCollator*`` and a ``get_scheduler`` schedule passed through ``optimizers=(opt, sched)``."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import Trainer, TrainingArguments

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _tokenizer():
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


class Recorder(transformers.TrainerCallback):
    """A user's callback written against transformers' base class."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("train_begin")

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step", state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", state.global_step, "eval_loss" in metrics))


def test_transformers_callbacks_collator_and_scheduler_with_our_trainer(tmp_path):
    torch.manual_seed(0)
    tok = _tokenizer()
    data = [tok(" ".join(f"w{(i * j) % 30}" for j in range(3 + i % 5))) for i in range(24)]  # ragged lengths
    config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = TrainingArguments(
        str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        logging_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        report_to="none",
        bf16=True,
        learning_rate=1e-2,
        disable_tqdm=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = transformers.get_scheduler("cosine", optimizer=opt, num_warmup_steps=2, num_training_steps=12)
    recorder = Recorder()
    # A threshold no evaluation can beat: transformers' callback stops the run after patience=1 evaluation.
    stopper = transformers.EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data[:8],
        optimizers=(opt, sched),
        data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[recorder, stopper],
    )
    result = trainer.train()

    assert result.global_step == 4 and trainer.state.global_step == 4  # stopped by transformers' callback
    assert recorder.events == [
        "train_begin",
        ("step", 1),
        ("step", 2),
        ("evaluate", 2, True),
        ("step", 3),
        ("step", 4),
        ("evaluate", 4, True),
    ]
    assert math.isfinite(result.training_loss) and trainer.accelerator.mixed_precision == "bf16"
    # get_scheduler's cosine schedule advanced once per optimizer step: 2 warmup steps, then 2 of 10 decaying.
    assert sched.get_last_lr()[0] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 2 / 10)))
