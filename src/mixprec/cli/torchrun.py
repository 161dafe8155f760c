"""``mixprec torchrun ARGS`` (or ``python -m mixprec.cli.torchrun ARGS``): torch's own ``torchrun`` (same
arguments, same elastic agent), ending the way a batch scheduler expects.

torchrun, sent SIGTERM (a preemption, ``scancel``), forwards it to its workers, waits for them (the
Trainer's workers save a checkpoint at the next step boundary and ``mixprec train``'s exit 143), then dies
with a Python traceback (``SignalException``) and status 1, so the scheduler cannot tell a preemption from a crash. This
runs the same launcher and turns that ending into one line and status 128 + the signal (143 for SIGTERM);
a failed worker group ends with one line per failed rank and status 1, instead of torch's traceback.
Nothing else differs: the rendezvous, the restarts (``--max-restarts``) and the workers are torchrun's.

One default is changed, for multi-node restarts: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set), so
each rendezvous round gives the workers a fresh store. With torch's default the workers of every round share
the c10d rendezvous store, and mixprec keeps the rounds apart by prefixing its keys with the restart count;
but that count is kept per node, and after a restart the nodes can disagree on it (see
:mod:`mixprec.strategies.restarts`), so their workers would look for each other under different prefixes.
Users of plain ``torchrun`` on several nodes with ``--max-restarts`` should set the variable themselves.

    mixprec torchrun --nnodes=2 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=host0:29500 -m mixprec.cli.main train --output-dir /shared/runs/x
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = _nproc_problem(str(args.nproc_per_node))
    if problem is not None:  # torch's own check ends in a traceback (an AssertionError, or a ValueError)
        print(f"mixprec torchrun: error: --nproc-per-node {args.nproc_per_node}: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # one fresh store per round (see above)
    try:
        run(args)
    except SignalException as err:
        signum = int(err.sigval)
        print(
            f"mixprec torchrun: stopped by signal {signum}; the workers were asked to stop (the Trainer saves a "
            "checkpoint first); relaunch the same command to resume",
            file=sys.stderr,
        )
        return 128 + signum
    except ChildFailedError as err:
        for rank, failure in sorted(err.failures.items()):
            why = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            print(f"mixprec torchrun: rank {rank} failed ({why})", file=sys.stderr)
        return 1
    return 0


def _nproc_problem(value: str) -> str | None:
    """What is wrong with an --nproc-per-node value torch's launcher would fail on, or None: torch takes a
    positive integer, or "auto", "cpu", "gpu" (torch.distributed.run)."""
    if value in ("auto", "cpu", "gpu"):
        return None
    try:
        n = int(value)
    except ValueError:
        return "expected a number of processes (e.g. 2), or auto, cpu, gpu"
    return None if n >= 1 else "expected at least 1 process per node (e.g. --nproc-per-node 2)"


if __name__ == "__main__":
    sys.exit(main())
