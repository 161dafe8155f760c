"""``mixprec replay``: run a bad step again from its capsule, in fp32 and in the run's precision, and name the
first module whose output goes non-finite or leaves fp32's, with its dtype's range (see
:mod:`mixprec.watch.replay`). Capsules are written by the precision watch (``mixprec train --watch N``) into
``<output_dir>/capsules/step-N`` when a step is non-finite or its loss spikes."""

from __future__ import annotations

import argparse
import json

from mixprec.cli._subcommand import Subcommand
from mixprec.cli.main import CliError

EPILOG = """\
examples:
  mixprec replay runs/x/capsules/step-00000412          fp32 vs the run's precision, first module apart
  mixprec replay runs/x/capsules/step-00000412 --json   the finding as JSON on stdout
  mixprec replay CAPSULE --tol 0.02                     call a 2% relative distance to fp32 a divergence

The capsule is verified (SHA-256 of every file) before anything is read; it holds safetensors and JSON only.
The built-in GPT and transformers models are rebuilt from the capsule; for another model, replay from Python:
mixprec.watch.replay(CAPSULE, model=YourModel(...)).
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("capsule", metavar="CAPSULE", help="a capsule folder (<run>/capsules/step-N)")
    parser.add_argument("--device", default="cpu", help="where to replay (default: cpu)")
    parser.add_argument(
        "--tol",
        metavar="X",
        type=float,
        default=None,
        help="relative L2 distance to fp32 that counts as diverged (default: 0.1)",
    )
    parser.add_argument("--json", action="store_true", help="print the finding as JSON")


def run(args: argparse.Namespace) -> int:
    # deferred (start-up): torch loads only when the replay runs, so `mixprec replay --help` answers at once
    from mixprec.watch.replay import DEFAULT_TOL, replay

    if args.tol is not None and not args.tol > 0:
        raise CliError(f"--tol {args.tol}: the relative distance must be > 0, e.g. --tol {DEFAULT_TOL}")
    _check_device(args.device)
    result = replay(args.capsule, device=args.device, tol=DEFAULT_TOL if args.tol is None else args.tol)
    print(json.dumps(result.to_dict(), allow_nan=False) if args.json else result.message())
    return 0


def _check_device(name: str) -> None:
    """A device torch knows and this machine has, checked before the capsule is read (one line, not torch's
    traceback at the first tensor moved)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CliError(f"--device {name}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name}: torch sees no CUDA device here; replay with --device cpu")


COMMAND = Subcommand(
    name="replay",
    description="Replay a bad step's capsule and find the first module that diverges or goes non-finite.",
    epilog=EPILOG,
    add_arguments=_add_arguments,
    run=run,
)
