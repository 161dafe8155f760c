"""A Trainer run for the kill tests in test_checkpointing.py (run as a subprocess; not collected by pytest).

    python trainer_kill_script.py OUT PRECISION MODE

MODE:
  reference   train MAX_STEPS steps without interruption, write OUT/final.safetensors
  resume      train(resume_from_checkpoint=True) to MAX_STEPS, write OUT/final.safetensors
  victim      train, and once checkpoint-SAVE_STEPS exists touch OUT/ready and slow down, so the parent
              can kill -9 the process between two checkpoints
  save-victim train, and hang in the middle of writing the second checkpoint (after OUT/saving appears)
  sigterm     train slowly; OUT/ready appears after the first step, so the parent can send SIGTERM
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from mixprec import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from mixprec.checkpoint import save_tensors  # noqa: E402
from trainer_utils import make_examples, make_model  # noqa: E402

MAX_STEPS = 12
SAVE_STEPS = 4


class Pace(TrainerCallback):
    """Touch ``ready`` once checkpoint ``after`` exists, then sleep ``delay`` per step."""

    def __init__(self, out: Path, after: int, delay: float) -> None:
        self.out, self.after, self.delay = out, after, delay

    def on_save(self, args, state, control, **kwargs):
        if state.global_step >= self.after:
            (self.out / "ready").touch()

    def on_step_end(self, args, state, control, **kwargs):
        if self.after == 0:
            (self.out / "ready").touch()
        if (self.out / "ready").exists():
            time.sleep(self.delay)


def hang_in_second_save(out: Path) -> None:
    """Patch the Accelerator's JSON writer so that writing checkpoint-8's trainer state never finishes."""
    import mixprec.accelerator.state as state_module

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
        callbacks.append(Pace(out, SAVE_STEPS, 1.0))
    if mode == "sigterm":
        callbacks.append(Pace(out, 0, 0.5))
    if mode == "save-victim":
        hang_in_second_save(out)
    trainer = build_trainer(out, precision, callbacks)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    save_tensors(trainer.model.state_dict(), out / "final.safetensors")


if __name__ == "__main__":
    main()
