"""One process of the Trainer's torchrun test (launched by test_trainer_distributed.py; not collected).

    torchrun --nproc_per_node=2 trainer_torchrun_script.py OUT

Each rank trains the same Trainer run (DDP over gloo, fp16), then writes OUT/rank<i>.json with what the test
compares: its final parameters, whether it wrote logs, and its evaluation metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Trainer, TrainingArguments  # noqa: E402
from trainer_utils import VOCAB, accuracy, leave, make_examples, make_model  # noqa: E402


def metrics(eval_pred) -> dict[str, float]:
    return {**accuracy(eval_pred), "examples": float(len(eval_pred.label_ids))}


def pad_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Dynamic padding: each batch as long as its longest example (input 0, label -100)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])], labels[i, : len(f["labels"])] = f["input_ids"], f["labels"]
    return {"input_ids": ids, "labels": labels}


def ragged_examples(n: int) -> list[dict[str, torch.Tensor]]:
    """Lengths 3, 4, 5, 6, 3, ...: with eval batches of 2, rank 0's first batch is 4 long and rank 1's 6."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, VOCAB, (3 + i % 4,), generator=g) for i in range(n)]
    return [{"input_ids": row, "labels": (row + 1) % VOCAB} for row in rows]


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=str(out / "run"),
        fp16=True,
        num_train_epochs=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="epoch",
        save_strategy="epoch",
        disable_tqdm=True,
        save_plots=False,
        per_device_eval_batch_size=2,
    )
    # 22 examples over 2 processes x batch 4: 3 steps per epoch; the validation set (7) splits unevenly
    trainer = Trainer(
        make_model(),
        args,
        train_dataset=make_examples(22),
        eval_dataset=make_examples(7, 1),
        compute_metrics=metrics,
        data_collator=pad_collate,
    )
    result = trainer.train()
    # token-level predictions whose lengths differ between the processes: padded with -100, then gathered
    ragged = ragged_examples(7)
    predicted = trainer.predict(ragged)
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "num_processes": trainer.accelerator.num_processes,
        "global_step": result.global_step,
        "params": {k: v.tolist() for k, v in trainer.model.state_dict().items()},
        "writes_logs": trainer.events.metrics is not None,
        "evals": [e for e in trainer.state.log_history if "eval_loss" in e],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "train_loss": result.training_loss,
        "ragged": {
            "predictions_shape": list(predicted.predictions.shape),
            "labels": predicted.label_ids.tolist(),
            "expected_labels": [((ex["input_ids"] + 1) % VOCAB).tolist() for ex in ragged],
        },
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave(trainer.accelerator)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main()
