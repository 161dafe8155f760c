"""The seed's third level: ``Trainer`` on a Hugging Face ``datasets`` dataset, with ``compute_metrics``.

A small classifier learns whether a sequence of numbers sums above zero; the dataset is built in memory
(``datasets.Dataset.from_dict``, nothing downloaded) and split with ``train_test_split``:

    python examples/trainer_datasets.py [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import numpy as np
import torch
from torch import nn

from mixprec import Trainer, TrainingArguments


class SumClassifier(nn.Module):
    """forward(features, labels) -> {"loss", "logits"}: what an HF model returns, so the Trainer takes it."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 64), nn.GELU(), nn.Linear(64, 2))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.float(), labels)
        return out


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    features = rng.normal(size=(512, 16)).astype(np.float32)
    dataset = datasets.Dataset.from_dict({"features": features, "labels": (features.sum(1) > 0).astype(np.int64)})
    dataset = dataset.with_format("torch").train_test_split(test_size=0.25, seed=0)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            eval_strategy="epoch",
            bf16=True,
            num_train_epochs=2,
            learning_rate=3e-3,
            per_device_train_batch_size=32,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=SumClassifier(),
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            compute_metrics=compute_metrics,
        )
        trainer.train()
        metrics = trainer.evaluate()
    print(f"eval accuracy {metrics['eval_accuracy']:.3f}, eval loss {metrics['eval_loss']:.3f}")


if __name__ == "__main__":
    main()
