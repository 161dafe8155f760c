"""Gradients on the wire: the same DDP training step with each communication dtype, side by side.

``mixprec bench --nproc-per-node N`` launches N processes (torch's launcher); each runs this, and the main
process reports. Per setting (``comm_dtype`` fp32 / bf16 / fp16, :mod:`mixprec.strategies.comm`):

- **bytes all-reduced per step**, measured: one extra, untimed step runs under torch's profiler, and every
  collective the backend ran (``gloo:all_reduce`` / ``nccl:all_reduce`` events: element count and dtype) is
  added up on this process. That is the payload each process hands the backend; a ring all-reduce moves
  about 2 (N-1)/N times it over each process's links, the same factor for every setting;
- **step time**: median and interquartile range over interleaved rounds (each round times every setting,
  starting with a different one; STYLE.md habit 13), on the main process, whose steps wait for the others
  at every all-reduce;
- the **last training loss**, to show the settings trained alike.

Each setting trains its own DDP copy of the same initial model with its own AdamW, through the bench's one
step (``runner.run_steps``). Depends on the precision layer and on :mod:`mixprec.strategies.comm` (a leaf:
the hooks); it wraps the model in DDP itself rather than through the Accelerator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec.bench.runner import Arm, run_steps
from mixprec.bench.timing import Summary, summarize
from mixprec.bench.workload import Workload
from mixprec.precision.base import Precision
from mixprec.strategies.comm import CommPrecision, make_comm
from mixprec.tree import strict_json

_ITEMSIZE = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "int": 4,
    "long int": 8,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
    "short int": 2,
}
"""Bytes per element of the dtype names torch's profiler gives a collective's inputs."""


@dataclass
class CommRow:
    """One setting's measurements."""

    comm: str
    bytes_per_step: int
    step: Summary
    last_loss: float


def bytes_all_reduced(step: Callable[[], object]) -> int:
    """Bytes this process handed the backend's collectives during ``step()`` (profiled: one untimed step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    total = 0
    for event in prof.events():
        if not event.name.endswith(":all_reduce"):  # gloo:all_reduce, nccl:all_reduce (the backend's own)
            continue
        for shape, dtype in zip(event.input_shapes, event.input_dtypes):
            total += math.prod(shape) * _ITEMSIZE.get(dtype, 4)
    return total


def run_comm_bench(
    workload: Workload,
    precision: Precision,
    comms: list[str],
    *,
    steps: int,
    rounds: int,
    warmup: int,
    lr: float,
    log: Callable[[str], None],
) -> list[CommRow]:
    """Every process calls it (a process group must exist); returns the rows (the same on every process
    but the times, which are this process's)."""
    device, rank = precision.device, dist.get_rank()
    batches = [{k: v.to(device) for k, v in b.items()} for b in workload.batches]
    settings = [make_comm(c, "--comm-dtypes") for c in comms]
    arms = [_make_arm(workload, precision, comm, lr) for comm in settings]
    for arm in arms:
        run_steps(arm, batches, warmup, timed=False, shift=rank)
    for r in range(rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:  # each round starts with another setting
            dist.barrier()  # every process starts the setting's steps together
            run_steps(arm, batches, steps, timed=True, shift=rank)
        log(f"round {r + 1}/{rounds} done")
    rows = []
    for comm, arm in zip(settings, arms):
        counted = bytes_all_reduced(lambda arm=arm: run_steps(arm, batches, 1, timed=False, shift=rank))
        rows.append(CommRow(comm.name, counted, summarize(arm.times), float(arm.last_loss.float())))
    return rows


def _make_arm(workload: Workload, precision: Precision, comm: CommPrecision, lr: float) -> Arm:
    from torch.nn.parallel import DistributedDataParallel

    model = precision.convert_module(workload.fresh_model(precision.device))
    device_ids = [precision.device.index] if precision.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)  # broadcasts rank 0's weights
    comm.register(ddp)
    optimizer = precision.convert_optimizer(torch.optim.AdamW(ddp.parameters(), lr=lr))
    return Arm(precision, ddp, optimizer, precision.make_scaler())


def format_comm_table(rows: list[CommRow], processes: int, description: str) -> str:
    """The report: one line per setting, bytes and time also as ratios to the first setting (fp32)."""
    base = rows[0]
    lines = [
        f"mixprec bench: gradients on the wire, {processes} processes, DDP",
        f"  {description}",
        f"  {'comm':<6} {'bytes/step':>12} {'vs ' + base.comm:>8} {'step ms':>9} {'IQR ms':>8} "
        f"{'vs ' + base.comm:>8} {'last loss':>10}",
    ]
    for row in rows:
        lines.append(
            f"  {row.comm:<6} {row.bytes_per_step:>12,} {row.bytes_per_step / max(base.bytes_per_step, 1):>8.2f} "
            f"{row.step.median * 1e3:>9.1f} {row.step.spread * 1e3:>8.1f} "
            f"{row.step.median / base.step.median:>8.2f} {row.last_loss:>10.4f}"
        )
    lines.append(
        "  bytes/step: the payload this process handed the backend's all-reduces in one step (profiled); "
        "step ms: median on the main process"
    )
    return "\n".join(lines)


def comm_to_json(rows: list[CommRow], processes: int, description: str, config: dict[str, object]) -> str:
    """The ``--json`` document of ``bench --nproc-per-node``: the table's figures, times in seconds, the ratios
    against the first setting (fp32); ``config`` holds the settings it ran with (steps, rounds, precision...)."""
    base = rows[0]
    results = [
        {
            "comm": row.comm,
            "bytes_per_step": row.bytes_per_step,
            "bytes_vs_first": row.bytes_per_step / max(base.bytes_per_step, 1),
            "step_time_s": row.step.median,
            "step_time_spread_s": row.step.spread,
            "step_time_min_s": row.step.minimum,
            "step_time_max_s": row.step.maximum,
            "timed_steps": row.step.count,
            "step_time_vs_first": row.step.median / base.step.median,
            "last_loss": row.last_loss,
        }
        for row in rows
    ]
    doc = {"processes": processes, "workload": description, "config": config, "results": results}
    return json.dumps(strict_json(doc), indent=2, allow_nan=False)
