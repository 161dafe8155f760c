"""One process of the elastic and lost-peer tests (launched by test_elastic.py and benchmarks/soak_elastic.py
under torchrun; not collected by pytest).

    torchrun --nproc_per_node=2 [--max-restarts=N] elastic_worker.py OUT

A Trainer run (DDP over gloo, fp16 with its scaler, dropout: a resume that restored any state wrongly would
change the result) of MAX_STEPS steps, a checkpoint every SAVE_STEPS. What goes wrong is set by the
environment:

  ELASTIC_KILL=RANK:STEP   that rank SIGKILLs itself when STEP steps are done, once (OUT/killed marks it);
                           RANK "any": this process, whatever its rank
  ELASTIC_HANG=RANK:STEP   that rank stops answering there (sleeps until a signal or OUT/release ends it);
                           RANK "any": this process, whatever its rank (a launcher of its own, as a "node")
  ELASTIC_TIMEOUT=S        TrainingArguments(ddp_timeout=S)
  ELASTIC_STEPS=N          MAX_STEPS (default 12)

Each rank that finishes writes OUT/final_rank<r>.json (its parameters); a rank whose run ends with an error
writes OUT/error_rank<r>.txt (the error's type and message) and the time, then re-raises.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Trainer, TrainerCallback, TrainingArguments, TrainingInterrupted  # noqa: E402
from trainer_utils import leave, make_examples, make_model  # noqa: E402

SAVE_STEPS = 3


def _target(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    rank, step = value.split(":")
    return (-1 if rank == "any" else int(rank)), int(step)


class Fault(TrainerCallback):
    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.kill, self.hang = _target("ELASTIC_KILL"), _target("ELASTIC_HANG")
        self.first_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step  # > 0: this run resumed from a checkpoint

    def on_step_begin(self, args, state, control, **kwargs):
        marker = self.out / "killed"
        if (
            self.kill is not None
            and self.kill[0] in (-1, self.rank)
            and self.kill[1] == state.global_step
            and not marker.exists()
        ):
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang is not None and self.hang[0] in (-1, self.rank) and self.hang[1] == state.global_step:
            (self.out / "hung_at").write_text(repr(time.time()))
            # stuck as a deadlocked process is; the launcher's SIGTERM ends it (a real deadlock: its SIGKILL)
            signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
            # torchrun starts workers in their own session, so killing the "node"'s process group leaves this
            # one orphaned. It must stay silent (its sockets open, as on a node that lost power) until the
            # test is done with the survivor, which touches OUT/release; a cap keeps it from leaking.
            release, cap = self.out / "release", time.monotonic() + 300
            while not release.exists() and time.monotonic() < cap:
                time.sleep(0.1)
            os._exit(137)


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a hung worker is
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    args = TrainingArguments(
        output_dir=str(out / "run"),
        fp16=True,
        max_steps=int(os.environ.get("ELASTIC_STEPS", "12")),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        disable_tqdm=True,
        save_plots=False,
        ddp_timeout=float(os.environ.get("ELASTIC_TIMEOUT", "60")),
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(40))
    fault = Fault(out, rank)
    trainer.add_callback(fault)
    try:
        result = trainer.train()
    except TrainingInterrupted as stop:  # stopped by the launcher's SIGTERM, after saving a checkpoint
        sys.exit(stop.exit_status)
    except Exception as err:
        (out / f"error_rank{rank}.txt").write_text(f"{time.time()!r}\n{type(err).__name__}: {err}")
        raise
    report = {
        "global_step": result.global_step,
        "first_step": fault.first_step,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "world_size": trainer.accelerator.num_processes,
        "params": {k: v.tolist() for k, v in trainer.model.state_dict().items()},
    }
    (out / f"final_rank{rank}.json").write_text(json.dumps(report))
    leave(trainer.accelerator)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main()
