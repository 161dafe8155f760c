"""``python -m mixprec.cli.torchrun ARGS``: torch's own ``torchrun`` (same arguments, same elastic agent), ending
the way a batch scheduler expects.

torchrun, sent SIGTERM (a preemption, ``scancel``), forwards it to its workers, waits for them (the
Trainer's workers save a checkpoint at the next step boundary and ``mixprec train``'s exit 143), then dies with a Python
traceback (``SignalException``) and status 1, so the scheduler cannot tell a preemption from a crash. This
runs the same launcher and turns that ending into one line and status 128 + the signal (143 for SIGTERM);
a failed worker group ends with one line per failed rank and status 1, instead of torch's traceback.
Nothing else differs: the rendezvous, the restarts (``--max-restarts``) and the workers are torchrun's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
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


if __name__ == "__main__":
    sys.exit(main())
