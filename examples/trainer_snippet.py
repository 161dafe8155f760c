"""The seed's third snippet, runnable: ``Trainer`` + ``TrainingArguments(evaluation_strategy="epoch", fp16=True)``.

Trains the built-in GPT ("tiny" preset) on the embedded corpus (this Python's standard library source,
nothing to download) for HF's default 3 epochs, in fp16 with loss scaling (really fp16, on a CPU too, where
fp16 arithmetic is emulated and slower than fp32: the point here is that it runs as written), evaluating at
the end of every epoch:

    python examples/trainer_snippet.py                         # writes ./results (a few minutes on 2 cores)
    python examples/trainer_snippet.py --corpus-bytes 4000     # a quick look
    torchrun --nproc_per_node=2 examples/trainer_snippet.py    # DDP: every process trains, the main one logs

./results then holds metrics.jsonl (every log entry, each skipped step with the layers whose gradients were
non-finite, each loss-scale change), loss_curves.png, loss_scale.png, train_summary.json and checkpoint-N
folders. A SIGTERM saves a checkpoint at the next step, then ``train()`` raises ``mixprec.TrainingInterrupted``;
``trainer.train(resume_from_checkpoint=True)`` continues from the latest complete checkpoint exactly where the
run stopped.
"""

from __future__ import annotations

import argparse

import torch

from mixprec import Trainer, TrainingArguments
from mixprec.data import CausalLMDataset, stdlib_corpus
from mixprec.models import GPT, GPT_PRESETS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-bytes", type=int, default=40_000, help="how much of the corpus to use")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per example (at most 64 for the tiny GPT)")
    return p.parse_args()


def compute_metrics(eval_pred):
    """Next-byte accuracy. Called with the whole validation set: logits (N, T, V) and label ids (N, T)."""
    predictions, labels = eval_pred
    # position t predicts byte t + 1: the model shifts its labels the same way
    hits = predictions[:, :-1].argmax(-1) == labels[:, 1:]
    return {"next_byte_accuracy": float(hits.mean())}


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    train_tokens, val_tokens = stdlib_corpus(args.corpus_bytes).split(0.1)
    dataset = {
        "train": CausalLMDataset(train_tokens, seq_len=args.seq_len),
        "validation": CausalLMDataset(val_tokens, seq_len=args.seq_len, split="validation"),
    }
    model = GPT(GPT_PRESETS["tiny"])

    # --- the seed's snippet ---------------------------------------------------------------------------
    training_args = TrainingArguments(output_dir="./results", evaluation_strategy="epoch", fp16=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["validation"],
        compute_metrics=compute_metrics,
    )

    trainer.train()
    # ---------------------------------------------------------------------------------------------------

    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "eval_loss" in entry:
                print(
                    f"epoch {entry['epoch']:.0f}: eval_loss {entry['eval_loss']:.3f}, "
                    f"next-byte accuracy {entry['eval_next_byte_accuracy']:.3f}"
                )


if __name__ == "__main__":
    main()
