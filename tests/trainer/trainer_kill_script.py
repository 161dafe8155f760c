"""A Trainer run for the kill tests in test_checkpointing.py (run as a subprocess; not collected by pytest).

    python trainer_kill_script.py OUT PRECISION MODE

MODE:
  reference   train MAX_STEPS steps without interruption, write OUT/final.safetensors
  resume      train(resume_from_checkpoint=True) to MAX_STEPS, write OUT/final.safetensors
  victim      train; once checkpoint-SAVE_STEPS exists touch OUT/ready, run one more step (logged), and
              hold at the start of the next until the parent kills -9 the process
  save-victim train, and hang in the middle of writing the second checkpoint (after OUT/saving appears)
  sigterm     train; touch OUT/ready after the first step and hold at the start of the second until the
              parent has sent SIGTERM (and touched OUT/signalled)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Trainer, TrainerCallback, TrainingArguments, TrainingInterrupted  # noqa: E402
from mixprec.checkpoint import save_tensors  # noqa: E402
from trainer_utils import make_examples, make_model  # noqa: E402

MAX_STEPS = 12
SAVE_STEPS = 4


class Pace(TrainerCallback):
    """At the start of step ``hold_at`` (every step before it has ended, been logged and, at a save step,
    saved), touch ``ready`` and hold until the parent has acted: a kill -9 ends the process there; after a
    SIGTERM the parent touches ``signalled`` and the step runs, to stop at its end. Holding, rather than
    merely slowing down, keeps the test deterministic however loaded the machine is (``ready`` touched any
    earlier let a kill -9 land before the steps in between were logged)."""

    def __init__(self, out: Path, hold_at: int) -> None:
        self.out, self.hold_at = out, hold_at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.hold_at:
            (self.out / "ready").touch()
            deadline = time.monotonic() + 120
            while not (self.out / "signalled").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def hang_in_second_save(out: Path) -> None:
    """Patch the Accelerator's JSON writer so that writing checkpoint-8's trainer state never finishes."""
    import mixprec.checkpoint.folder_format as state_module

    original = state_module.save_json

    def save_json(obj, path):
        written = original(obj, path)
        if Path(path).name == "trainer_state.json" and obj.get("global_step") == 2 * SAVE_STEPS:
            (out / "saving").touch()
            time.sleep(120)
        return written

    state_module.save_json = save_json


def build_trainer(out: Path, precision: str, callbacks: list | None = None) -> Trainer:
    """The run every kill test compares: 12 steps over 2.4 epochs of 5 batches, a checkpoint every 4 steps."""
    args = TrainingArguments(
        output_dir=str(out / "run"),
        precision=precision,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        logging_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        disable_tqdm=True,
        save_plots=False,
        seed=7,
    )
    return Trainer(make_model(), args, train_dataset=make_examples(20), callbacks=callbacks or [])


def main() -> None:
    out, precision, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)  # the same arithmetic in every process that is compared
    callbacks = []
    if mode == "victim":
        callbacks.append(Pace(out, hold_at=SAVE_STEPS + 2))
    if mode == "sigterm":
        callbacks.append(Pace(out, hold_at=2))
    if mode == "save-victim":
        hang_in_second_save(out)
    trainer = build_trainer(out, precision, callbacks)
    try:
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    except TrainingInterrupted as stop:  # what a script does to end as the signal would (status 143)
        sys.exit(stop.exit_status)
    save_tensors(trainer.model.state_dict(), out / "final.safetensors")


if __name__ == "__main__":
    main()
