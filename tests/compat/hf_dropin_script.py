"""An HF Trainer script as a user writes it: a streamed training set, gradient checkpointing, MLflow, the best
model restored at the end and early stopping. tests/compat/test_hf_dropin_script.py runs it as it is (with
transformers) and with the one import line switched to mixprec."""

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel

# isort: split
from transformers import EarlyStoppingCallback, Trainer, TrainingArguments  # the line a user changes

VOCAB, SEQ = 64, 16


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB  # learnable: +1 per token
    return {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()}


def main(output_dir):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    train = datasets.Dataset.from_dict(rows(64, 0)).to_iterable_dataset()  # streamed: no length
    valid = datasets.Dataset.from_dict(rows(16, 1))
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=12,  # a stream has no length: max_steps says how long
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        logging_steps=3,
        load_best_model_at_end=True,
        gradient_checkpointing=True,
        report_to=["mlflow"],
        run_name="drop-in",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=valid,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trainer.train()
    return trainer
