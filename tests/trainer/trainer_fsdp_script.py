"""The Trainer run of test_trainer_distributed.py's FSDP2 test (not collected).

    torchrun --nproc_per_node=2 trainer_fsdp_script.py OUT       FSDP2 over gloo, 2 x 4 examples a step
    python trainer_fsdp_script.py OUT                            one process, 8 examples a step (the reference)
    FSDP_STATE_DICT_TYPE=sharded torchrun ...                    the checkpoints as per-process shards
    RESUME=1 ...                                                 resume from the newest checkpoint in OUT/run

Three SGD steps in fp32 on the same 8 examples per step, an evaluation and a checkpoint after each; the
evaluation's score is scripted so that step 2 is the best and ``load_best_model_at_end`` has something to
do. Then ``save_model(OUT/saved)``. Each rank writes OUT/rank<i>.json with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import DistributedType, Trainer, TrainingArguments  # noqa: E402
from trainer_utils import leave, make_examples, make_model  # noqa: E402

SCORES = [1.0, 3.0, 2.0]  # evaluation after steps 1, 2, 3: step 2 is the best
BEST_STEP = 2


def build(out: Path, world_size: int) -> Trainer:
    scores = iter(SCORES)
    args = TrainingArguments(
        output_dir=str(out / "run"),
        distributed="fsdp" if world_size > 1 else None,
        fsdp_state_dict_type=os.environ.get("FSDP_STATE_DICT_TYPE", "full"),
        max_steps=len(SCORES),
        per_device_train_batch_size=8 // world_size,
        train_sampling_strategy="sequential",
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
        disable_tqdm=True,
        save_plots=False,
        report_to="none",
    )
    return Trainer(
        # a dict output: FSDP2 finds the output's tensors with torch's pytree to re-gather the parameters for
        # the backward, and trainer_utils' default Output class is not a pytree node
        # a resumed run starts from other weights: only loading the checkpoint can make it end as the original
        make_model(seed=1 if os.environ.get("RESUME") else 0, dropout=0.0, returns="dict"),
        args,
        train_dataset=make_examples(24),
        eval_dataset=make_examples(4, 1),
        compute_metrics=lambda eval_pred: {"score": next(scores)},
    )


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    trainer = build(out, int(os.environ.get("WORLD_SIZE", "1")))
    trainer.train(resume_from_checkpoint=True if os.environ.get("RESUME") else None)
    trainer.save_model(str(out / "saved"))
    acc = trainer.accelerator
    report = {
        "distributed": acc.distributed_type,
        "num_processes": acc.num_processes,
        "best_model_checkpoint": trainer.state.best_model_checkpoint,
        # what this process holds of one parameter: a shard under FSDP2, so a plain state_dict() is not the model
        "local_rows": int(next(iter(trainer.model.state_dict().values())).to_local().shape[0])
        if acc.distributed_type == DistributedType.FSDP
        else None,
    }
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(report))
    leave(acc)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main()
