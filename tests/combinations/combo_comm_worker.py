"""What tests/combinations/test_combinations_comm.py launches with torchrun (2 processes, gloo): each precision of
the matrix with one communication dtype, through the Accelerator, a few steps each; rank 1's gradient is planted
non-finite at step 2, so both ranks must skip it. Writes ``rank<N>.json`` into argv[1]. Not a test module."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from combo_checks import Plant, listening  # noqa: E402
from combo_levels import precision_name, set_race  # noqa: E402

from conftest import make_batches, make_tiny_lm  # noqa: E402
from mixprec import Accelerator  # noqa: E402
from trainer_utils import leave  # noqa: E402

COMM = json.loads(os.environ["COMBO_COMM"])  # {precision: comm dtype}
STEPS, SKIP_AT = 4, 2


class Env:
    """set_race's monkeypatch, for a script."""

    def setenv(self, name: str, value: str) -> None:
        os.environ[name] = value

    def delenv(self, name: str, raising: bool = True) -> None:
        os.environ.pop(name, None)

    def setattr(self, target: object, name: str, value: object) -> None:
        setattr(target, name, value)


def cell(precision: str, comm: str, rank: int, run: Path) -> dict:
    set_race(precision, Env())
    with listening() as said:
        try:
            acc = Accelerator(
                mixed_precision=precision_name(precision), cpu=True, comm_dtype=comm, project_dir=run, verbose=False
            )
        except ValueError as refused:
            return {"refused": str(refused)}
        model = make_tiny_lm(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
        plant = Plant(acc.unwrap_model(model).head.weight)
        skipped = []
        for step, batch in enumerate(make_batches(STEPS, seed=10 + rank), 1):
            plant.armed = rank == 1 and step == SKIP_AT
            acc.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
            optimizer.step()
            optimizer.zero_grad()
            skipped.append(acc.optimizer_step_was_skipped)
        weights = {k: v.detach().double().sum().item() for k, v in acc.unwrap_model(model).state_dict().items()}
        ran = acc.mixed_precision
        acc.wait_for_everyone()
    return {"weights": weights, "skipped": skipped, "ran": ran, "lines": said.lines}


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    results, acc = {}, None
    for precision, comm in COMM.items():
        results[precision] = cell(precision, comm, rank, Path.cwd() / f"run-{len(results)}")
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    acc = Accelerator(cpu=True, verbose=False)
    dist.barrier()
    leave(acc)


if __name__ == "__main__":
    main()
