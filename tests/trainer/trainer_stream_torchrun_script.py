"""Run by tests/trainer/test_trainer_features.py under ``torchrun --nproc_per_node=2``: a stream of 40 numbered
examples trained for 5 steps at batch 4; each process writes the example numbers it trained on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec import Trainer, TrainingArguments  # noqa: E402
from mixprec.loaders.from_datasets import default_collator  # noqa: E402
from trainer_utils import SEQ, VOCAB, leave, make_model  # noqa: E402


class Numbered(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(40):
            yield {"input_ids": torch.full((SEQ,), i % VOCAB), "labels": torch.full((SEQ,), i)}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    seen: list[int] = []

    def collate(features):
        seen.extend(int(f["labels"][0]) for f in features)
        batch = default_collator(features)
        batch["labels"] = batch["labels"] % VOCAB
        return batch

    args = TrainingArguments(
        output_dir=str(out / "run"),
        max_steps=5,
        per_device_train_batch_size=4,
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
    )
    trainer = Trainer(make_model(), args, data_collator=collate, train_dataset=Numbered())
    trainer.train()
    rank = trainer.accelerator.process_index
    report = {"seen": seen, "params": {k: v.tolist() for k, v in trainer.model.state_dict().items()}}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave(trainer.accelerator)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main()
