"""One process of the Accelerator's elastic test (launched by test_elastic.py under torchrun; not collected
by pytest): a hand-written fp16 loop with dropout that uses the restart pattern of the README,

    accelerator.resume_after_restart()

and saves an automatic checkpoint every SAVE_STEPS steps. ELASTIC_KILL=RANK:STEP makes that rank SIGKILL
itself before STEP, once (OUT/killed marks it). Each rank that finishes writes OUT/final_rank<r>.json.

    torchrun --nproc_per_node=2 [--max-restarts=N] elastic_accelerator_worker.py OUT
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Accelerator, ProjectConfiguration  # noqa: E402
from trainer_utils import leave  # noqa: E402

STEPS, SAVE_STEPS = 10, 3


class Progress:
    """The loop's position, saved and restored with the rest of the state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    kill = os.environ.get("ELASTIC_KILL")
    accelerator = Accelerator(
        mixed_precision="fp16",
        project_config=ProjectConfiguration(project_dir=str(out / "run"), automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resumed = accelerator.resume_after_restart()  # the pattern: after a restart, continue from the newest
    first = progress.step
    rank = accelerator.process_index
    for step in range(progress.step, STEPS):
        if kill == f"{rank}:{step}" and not (out / "killed").exists():
            (out / "killed").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step = step + 1
        if progress.step % SAVE_STEPS == 0:
            accelerator.save_state()
    report = {
        "first_step": first,
        "resumed_from": None if resumed is None else resumed.name,
        "params": {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()},
    }
    (out / f"final_rank{rank}.json").write_text(json.dumps(report))
    leave(accelerator)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main()
