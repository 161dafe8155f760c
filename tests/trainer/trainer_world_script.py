"""One process of the world-size-change tests (launched by test_trainer_world_change.py, alone or under
torchrun; not collected).

    [torchrun --nproc_per_node=2] trainer_world_script.py OUT [CHECKPOINT]

An epoch-sized Trainer run (2 epochs of 48 examples, batch 4 per process, cosine schedule, a checkpoint every
5 steps) into OUT/run, resumed from CHECKPOINT when given. Each rank writes OUT/rank<r>.json: the steps, the
run's max_steps, the learning rate of every logged step and the epoch it ended at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from trainer_utils import leave, make_examples, make_model  # noqa: E402


class FirstStep(TrainerCallback):
    first_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step


def main() -> None:
    out = Path(sys.argv[1])
    checkpoint = sys.argv[2] if len(sys.argv) > 2 else None
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=str(out / "run"),
        num_train_epochs=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="steps",
        save_steps=5,
        disable_tqdm=True,
        save_plots=False,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(48))
    first = FirstStep()
    trainer.add_callback(first)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    rank = trainer.accelerator.process_index
    report = {
        "world_size": trainer.accelerator.num_processes,
        "first_step": first.first_step,
        "global_step": result.global_step,
        "max_steps": trainer.state.max_steps,
        "epoch": trainer.state.epoch,
        "lrs": {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave(trainer.accelerator)


if __name__ == "__main__":
    main()
