"""``mixprec export``: one safetensors file with the full weights of a sharded FSDP2 checkpoint (a save_sharded
folder, or a save_state / Trainer checkpoint saved with ``fsdp_state_dict_type="sharded"``), for inference
or for a run on another number of processes that wants plain weights (see :mod:`mixprec.checkpoint.sharded`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.cli._subcommand import Subcommand
from mixprec.cli.main import CliError

EPILOG = """\
examples:
  mixprec export runs/x/sharded model.safetensors     a folder written by save_sharded(), by any number
                                                      of processes, into one file; no process group needed
  mixprec export runs/x/checkpoint-500 model.safetensors
                                                      the model of a checkpoint saved with
                                                      fsdp_state_dict_type="sharded" (its model_0.dcp)

The folder's manifest is verified first: a damaged or unfinished checkpoint is refused by name.
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        metavar="SHARDED_FOLDER",
        help="the folder save_sharded() wrote, or a checkpoint saved with fsdp_state_dict_type='sharded'",
    )
    parser.add_argument("output", metavar="OUTPUT", help="the .safetensors file to write (replaced atomically)")


def run(args: argparse.Namespace) -> int:
    # deferred (start-up): torch loads only when the export runs, so `mixprec export --help` answers at once
    from mixprec.checkpoint.sharded import export_safetensors

    if not str(args.output).endswith(".safetensors"):
        raise CliError(f"OUTPUT {args.output!r}: name a .safetensors file, e.g. {Path(args.folder).name}.safetensors")
    if not Path(args.output).resolve().parent.is_dir():  # before the gather, and in the user's words
        raise CliError(f"OUTPUT {args.output}: the folder {Path(args.output).parent} does not exist; create it first")
    written = export_safetensors(args.folder, args.output)
    print(f"mixprec export: {written} ({written.stat().st_size / 2**20:.1f} MiB)")
    return 0


COMMAND = Subcommand(
    name="export",
    description="Gather a sharded checkpoint (save_sharded) into one safetensors file.",
    epilog=EPILOG,
    add_arguments=_add_arguments,
    run=run,
)
