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

sys.path.insert(0, str(Path(__file__).parent))
from mixprec import Trainer, TrainingArguments  # noqa: E402
from trainer_utils import accuracy, leave, make_examples, make_model  # noqa: E402


def metrics(eval_pred) -> dict[str, float]:
    return {**accuracy(eval_pred), "examples": float(len(eval_pred.label_ids))}


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
    )
    # 22 examples over 2 processes x batch 4: 3 steps per epoch; the validation set (7) splits unevenly
    trainer = Trainer(
        make_model(), args, train_dataset=make_examples(22), eval_dataset=make_examples(7, 1), compute_metrics=metrics
    )
    result = trainer.train()
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "num_processes": trainer.accelerator.num_processes,
        "global_step": result.global_step,
        "params": {k: v.tolist() for k, v in trainer.model.state_dict().items()},
        "writes_logs": trainer.events.metrics is not None,
        "evals": [e for e in trainer.state.log_history if "eval_loss" in e],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave(trainer.accelerator)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main()
