"""``mixprec diagnose``: how much of the gradients fp16 would flush to zero, which layer overflows, and which
loss scale to start from — measured on the user's model and data (default: those of ``mixprec train``)."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from mixprec.accelerator.accelerator import Accelerator
from mixprec.cli._common import (
    add_data_model_args,
    check_plot_file,
    load_model_and_data,
    parse_precision,
    positive_int,
)
from mixprec.cli._subcommand import Subcommand
from mixprec.diagnostics import diagnose
from mixprec.models.outputs import extract_loss
from mixprec.precision.registry import autocast_modes

# Sized for the one-minute budget on 2 CPU cores: without native fp16 on the CPU, each fp16 pass of the
# non-finite search costs ~10x an fp32 pass, so one batch is searched; the fp32 histograms use every batch.
DEFAULT_BATCH_SIZE = 8
DEFAULT_BATCHES = 2

EPILOG = """\
examples:
  mixprec diagnose                           the built-in GPT and corpus of `mixprec train`
  mixprec diagnose --json > report.json      the report alone on stdout, as JSON
  mixprec diagnose --precision bf16          search for the first non-finite module under bf16
  mixprec diagnose --data notes.txt --model ./my-hf-model --batches 4
  mixprec diagnose --plot runs/hist.png      also draw the histograms into that PNG (default: no file)

The diagnosis runs a few forward/backward passes in fp32 with hooks, histograms each layer's activations
and gradients against the fp16 and bf16 ranges, recommends a precision and an initial loss scale, and runs
one pass under the target precision to find the first module whose output or gradient is inf/NaN.
The model and its gradients are left as they were. Under torchrun every process runs the diagnosis (the race
is a collective) and the main process alone prints the report and writes the plot.
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_model_args(parser, batch_size=DEFAULT_BATCH_SIZE, precision="fp16")
    group = parser.add_argument_group("diagnosis")
    group.add_argument(
        "--batches",
        metavar="N",
        type=positive_int,
        default=DEFAULT_BATCHES,
        help=f"batches measured in fp32 (default: {DEFAULT_BATCHES})",
    )
    group.add_argument(
        "--nonfinite-batches",
        metavar="N",
        type=positive_int,
        default=1,
        help="batches run under the target precision to find the first non-finite module (default: 1)",
    )
    group.add_argument("--lr", metavar="X", type=float, default=1e-3, help="for the bf16 lost-update estimate")
    group.add_argument("--top", metavar="N", type=positive_int, default=15, help="layers shown (default: 15)")
    # no file unless asked (issue 29: a PNG appeared in whatever folder the user stood in)
    group.add_argument("--plot", metavar="PNG", default=None, help="draw the histograms into this PNG (default: none)")
    group.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)  # the default; kept for old scripts
    group.add_argument("--json", action="store_true", help="print only the report as JSON on stdout")


def _speed(acc: Accelerator, model: torch.nn.Module, batch: Any, report: Any, log: Any) -> dict[str, Any]:
    """Race the modes the diagnosis judged safe on one batch, as ``mixprec train`` under auto does on its
    first (same race, same rule), and make the recommendation the fastest of them (issue 29: diagnose
    recommended fp16 where bench measured fp16 at 0.10x fp32 and auto picked bf16). Costs a few
    forward+backward passes; the model is left as found (the race runs on a copy). ``acc``: an "auto"
    Accelerator (under torchrun every process races, and they agree on the main one's verdict)."""
    log("racing the safe modes on one batch (what auto would pick here)")
    device = acc.device
    copy_ = acc.prepare(copy.deepcopy(model))
    batch = {k: v.to(device) for k, v in batch.items()}
    # left out of the race: each mode computing in a format the diagnosis judged (its modes' own) and not safe
    why = "the diagnosis judged it unsafe for this model"
    judged = [m.format.name for m in autocast_modes(device)]
    unsafe = {fmt: why for fmt in judged if fmt not in report.safe_precisions}
    decision = acc.settle_precision(lambda: extract_loss(copy_(**batch)), batch, unsafe_formats=unsafe)
    if decision is None:
        return {}
    report.recommended_precision = decision.chosen
    speed = decision.speedups()
    timed = ", ".join(f"{n} {speed[n]:.2f}x" for n in decision.step_seconds)
    dropped = "".join(f"; {n} dropped: not faster" for n in decision.dropped)
    summary = (
        f"auto's race on this batch ({decision.clock}, {decision.rounds} paired rounds): {timed or '-'}{dropped}; "
        f"fastest safe: {decision.chosen}"
    )
    return {**decision.to_dict(), "summary": summary}


def run(args: argparse.Namespace) -> int:
    precision = parse_precision(args.precision, getattr(args, "fp32_ops", None))
    plot = None if args.no_plot else args.plot
    if plot is not None:
        check_plot_file("--plot", plot)  # up front: not after the whole diagnosis
    # Under torchrun every process diagnoses the same batches (the race in _speed is a collective), and the
    # main process alone reports: one report, one plot, as train and bench (the probe: one per process).
    acc = Accelerator(mixed_precision="auto", verbose=False)
    main = acc.is_main_process
    model, train, _val, info = load_model_and_data(args, precision=precision)
    device = acc.device  # cuda:LOCAL_RANK under torchrun on GPUs, else the default device
    model.to(device)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, generator=generator)

    def log(msg: str) -> None:  # progress: on stderr under --json (stdout holds the report alone)
        if main:
            print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    log(
        f"diagnosing {info.model_description} on {device}; {info.corpus}; "
        f"{args.batches} batch(es) of {args.batch_size} x {info.seq_len} tokens"
    )
    report = diagnose(
        model,
        loader,
        device=device,
        precision_target=precision.narrowest_format().name,  # its own format; "auto" may pick fp16: its range
        max_batches=args.batches,
        nonfinite_batches=min(args.nonfinite_batches, args.batches),
        lr=args.lr,
    )
    report.speed = _speed(acc, model, next(iter(loader)), report, log)
    if main:
        if plot is not None:
            log(f"histograms written to {report.plot(Path(plot))}")
        if args.json:
            print(json.dumps(report.to_dict()), flush=True)
        else:
            print(report.table(top=args.top), flush=True)
    acc.end_training()  # every process, once the main one has reported: leave the process group together
    return 0


COMMAND = Subcommand(
    name="diagnose",
    description="Diagnose what fp16 and bf16 would do to a model's activations and gradients.",
    epilog=EPILOG,
    add_arguments=_add_arguments,
    run=run,
)
