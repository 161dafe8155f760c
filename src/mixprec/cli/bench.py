"""``mixprec bench``: the same model and data under fp32, fp16, bf16 and "auto", side by side."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from mixprec.bench import BenchConfig, Workload, format_table, run_bench, to_json, workload_from_dataset, write_chart
from mixprec.bench.comm_bench import comm_to_json, format_comm_table, run_comm_bench
from mixprec.bench.runner import loss_of
from mixprec.cli import torchrun
from mixprec.cli._common import (
    add_data_model_args,
    check_plot_file,
    load_model_and_data,
    nonnegative_int,
    positive_int,
)
from mixprec.cli._config_file import explicit_flags
from mixprec.cli._subcommand import Subcommand
from mixprec.cli.main import CliError
from mixprec.models import GPT_PRESETS
from mixprec.precision.base import default_device
from mixprec.precision.op_timing import measure_op_kinds
from mixprec.precision.policy import POLICY_BASES
from mixprec.precision.registry import canonical_name, resolve_precision
from mixprec.strategies.comm import make_comm

# The default run must finish in well under a minute on 2 shared CPU cores, where one fp16 step of the
# default model is ~10x an fp32 step: hence a small batch and few steps. Raise them for steadier numbers.
DEFAULT_BATCH_SIZE = 4
DEFAULT_SEQ_LEN = 64
# One intra-op thread on a CPU by default: with several, OpenMP threads of a small model wait on each other
# whenever anything else runs on the machine, and the timings measure the neighbours (on the shared 2-core
# dev box at load 7, the default run took 203 s with 2 threads and the fp32 step was ~13x slower than with
# 1, squeezing the ratios between precisions). --threads N measures a multi-threaded run.
CPU_THREADS = 1
# more distinct batches than this add nothing to a timing run; steps beyond it cycle through them
_MAX_BATCHES = 64
_WORKLOAD_FLAGS = ("data", "text_field", "model", "seq_len", "batch_size", "seed")

EPILOG = """\
examples:
  mixprec bench                                 built-in GPT, fp32 / fp16 / bf16 / auto, table on stdout
  mixprec bench --steps 5 --rounds 5            steadier medians (takes longer)
  mixprec bench --precisions fp32,bf16 --model tiny
  mixprec bench --json > bench.json             the JSON document alone on stdout, progress on stderr
  mixprec bench --output bench.png              also write a PNG chart
  mixprec bench --data notes.txt --model ./my-hf-model --batch-size 8 --seq-len 256
  mixprec bench --threads 2                     a multi-threaded CPU run (default: 1 thread, steadier)
  mixprec bench --nproc-per-node 2 --model tiny gradients on the wire: bytes and step time per --comm-dtypes
  mixprec bench --precisions fp32,bf16 --policy bf16:fp32_ops=attention   bf16 with attention in fp32 beside
  mixprec bench --precisions fp32,bf16 --policy measured   time each op kind first, add the policy it makes

bench's defaults differ from train's: --batch-size 4 and --seq-len 64 (an fp16 or bf16 step can be ~10x
an fp32 step on a CPU without native support), and one torch thread on a CPU (several threads of a small
model wait on each other whenever anything else runs, so the timings would measure the neighbours).
--precision is train's flag: bench compares several, given with --precisions.

Each precision trains its own copy of the same initial model on the same batches; rounds are interleaved
(each round times every precision, starting with a different one), and the median per-step time is
reported with its interquartile range. Peak memory: CUDA max_memory_allocated, or on a CPU (Linux) the
growth of the process's peak resident set while a fresh copy trains, after warm-up. MFU is against a
matmul of the same dtype measured at start on this machine (the peak is named in the output).

--nproc-per-node N (N >= 2) launches N processes (torch's launcher, one machine) that train DDP copies of the
model with their gradients all-reduced in each of --comm-dtypes (default fp32,bf16,fp16), and reports bytes
all-reduced per step (profiled) and step time per setting; --precisions then names one precision (default fp32),
or --policy a spelled-out policy. --json prints the comparison as one JSON document; --output (the chart) and
--policy measured are the one-process bench's, refused with --nproc-per-node; it measures no memory.
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_model_args(parser, batch_size=DEFAULT_BATCH_SIZE, seq_len=DEFAULT_SEQ_LEN)
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--precisions",
        metavar="LIST",
        default="fp32,fp16,bf16,auto",
        help="comma-separated precisions to compare (default: fp32,fp16,bf16,auto)",
    )
    group.add_argument("--steps", metavar="N", type=positive_int, default=2, help="timed steps per round (default: 2)")
    group.add_argument("--rounds", metavar="N", type=positive_int, default=3, help="interleaved rounds (default: 3)")
    group.add_argument(
        "--warmup", metavar="N", type=nonnegative_int, default=1, help="untimed steps per precision first (default: 1)"
    )
    group.add_argument("--lr", metavar="X", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    group.add_argument(
        "--threads",
        metavar="N",
        type=positive_int,
        default=None,
        help=f"torch intra-op threads (default: {CPU_THREADS} on a CPU, see below; torch's own with CUDA)",
    )
    group.add_argument(
        "--nproc-per-node",
        metavar="N",
        type=_two_or_more,
        default=1,  # one process, no comparison of communication dtypes (the flag itself asks for N >= 2)
        help="N >= 2: DDP over N processes, comparing --comm-dtypes (the dtype gradients are all-reduced in)",
    )
    group.add_argument(
        "--comm-dtypes",
        metavar="LIST",
        default="fp32,bf16,fp16",
        help="with --nproc-per-node: comma-separated communication dtypes to compare (default: fp32,bf16,fp16)",
    )
    group.add_argument(
        "--policy",
        metavar="SPEC|measured[:MODE]",
        default=None,
        help="add a per-op-kind policy row, e.g. bf16:fp32_ops=attention; 'measured' (or measured:fp16) times "
        "each op kind on this workload's first batch and adds the policy its winners make",
    )
    group.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    group.add_argument("--json", action="store_true", help="print only the JSON document on stdout")
    group.add_argument("--output", metavar="PNG", default=None, help="write a chart of step time and memory")


def _two_or_more(text: str) -> int:
    """argparse type of --nproc-per-node: the comparison of communication dtypes needs two processes or more."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"{value} process has no gradients to communicate: give N >= 2 to compare "
            "--comm-dtypes, or leave the flag out for a one-process bench"
        )
    return value


def _workload_args(args: argparse.Namespace) -> dict[str, Any]:
    values = {name: getattr(args, name) for name in _WORKLOAD_FLAGS}
    if values["seq_len"] is None:
        # bench's own default (shorter than train's); a Hugging Face model keeps the shared default
        preset = GPT_PRESETS.get(values["model"])
        values["seq_len"] = min(DEFAULT_SEQ_LEN, preset.block_size) if preset else None
    return values


def _build_workload(values: dict[str, Any], num_batches: int) -> Workload:
    namespace = argparse.Namespace(**values, precision="auto")
    model, train, val, info = load_model_and_data(namespace)
    description = f"{info.model_description}; {info.corpus}; batch {values['batch_size']} x {info.seq_len} tokens"
    return workload_from_dataset(
        model,
        train,
        val,
        batch_size=values["batch_size"],
        num_batches=num_batches,
        seed=values["seed"],
        description=description,
    )


def _measured_base(policy: str | None) -> str | None:
    """The autocast mode of ``--policy measured[:MODE]`` (default bf16), None for a spelled-out policy."""
    if policy is None or not policy.strip().lower().startswith("measured"):
        return None
    _, _, mode = policy.partition(":")
    base = canonical_name(mode) if mode.strip() else "bf16"
    if base not in POLICY_BASES:
        raise CliError(f"--policy {policy!r}: measured policies refine bf16 or fp16 (e.g. --policy measured:fp16)")
    return base


def _measure_policy(workload: Workload, base: str) -> Any:
    """Per-op-kind timing on a fresh copy of the model and the workload's first batch (mixprec.precision.op_timing)."""
    device = default_device()
    model = workload.fresh_model(device)
    batch = {k: v.to(device) for k, v in workload.batches[0].items()}
    return measure_op_kinds(lambda: loss_of(model(**batch)), device, base)


def run(args: argparse.Namespace) -> int:
    if "precision" in explicit_flags(args):
        raise CliError(
            f"bench compares several precisions: use --precisions (e.g. --precisions fp32,{args.precision}), "
            f"not --precision"
        )
    if "fp32_ops" in explicit_flags(args):
        raise CliError(
            "--fp32-ops: bench adds a per-op-kind policy as a row of its own: use --policy bf16:fp32_ops=..."
        )
    threads = args.threads if args.threads is not None else (None if torch.cuda.is_available() else CPU_THREADS)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if args.nproc_per_node > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return _run_comm(args)
        if "comm_dtypes" in explicit_flags(args):  # it was ignored: one process communicates nothing
            raise CliError("--comm-dtypes compares processes' gradient traffic: add --nproc-per-node 2 (or more)")
        return _run(args)
    finally:
        torch.set_num_threads(previous)  # a caller of main() (a notebook, a test) keeps its own setting


def _log(msg: str) -> None:
    """A progress line, on stderr (stdout holds the table or the JSON document)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _run_comm(args: argparse.Namespace) -> int:
    """--nproc-per-node: launch the processes (from the command line), or be one of them (under the launcher)."""
    comms = [c.strip() for c in args.comm_dtypes.split(",") if c.strip()]
    try:
        names = [make_comm(c, "--comm-dtypes").name for c in comms]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not names:
        raise CliError("--comm-dtypes: give at least one of fp32, bf16, fp16")
    precisions = _comm_precision(args)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in _workload_args(args).items() if v is not None]
        # a policy's own commas would be split by --precisions: it travels under its own flag
        flags += [f"--policy={args.policy}" if args.policy is not None else f"--precisions={precisions[0]}"]
        flags += [f"--comm-dtypes={','.join(names)}"]
        flags += [f"--{name}={getattr(args, name)}" for name in ("steps", "rounds", "warmup", "lr")]
        flags += [f"--threads={args.threads}"] if args.threads is not None else []
        flags += ["--json"] if args.json else []
        launch = ["--standalone", f"--nproc-per-node={args.nproc_per_node}", "-m", "mixprec.cli.main", "bench"]
        return torchrun.main([*launch, *flags])
    return _comm_worker(args, precisions[0], names)


def _comm_precision(args: argparse.Namespace) -> list[str]:
    """The one precision the processes train in: --precisions (default fp32) or a spelled-out --policy. The
    flags of the one-process bench that the comparison of communication dtypes has no use for are refused
    here, before any process starts, rather than ignored (--no-memory is kept: it measures no memory)."""
    if args.output:
        raise CliError(
            f"--output {args.output}: the chart is the one-process bench's (step time and memory per precision); "
            "with --nproc-per-node use the table or --json"
        )
    explicit = explicit_flags(args)
    if args.policy is not None:
        if _measured_base(args.policy) is not None:
            raise CliError(
                f"--policy {args.policy}: a measured policy is timed in one process; run `mixprec bench --policy "
                f"{args.policy}` first, then give the policy it prints to --policy with --nproc-per-node"
            )
        if "precisions" in explicit:
            raise CliError("--nproc-per-node trains one precision: give --policy or --precisions, not both")
        try:
            return [canonical_name(args.policy)]
        except ValueError as exc:
            raise CliError(f"--policy: {exc}") from None
    precisions = args.precisions.split(",") if "precisions" in explicit else ["fp32"]
    if len(precisions) != 1:
        raise CliError(
            f"--nproc-per-node compares communication dtypes: give one precision (--precisions fp32), "
            f"not {args.precisions!r}"
        )
    return precisions


def _comm_worker(args: argparse.Namespace, precision_name: str, comms: list[str]) -> int:
    import torch.distributed as dist

    env_rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    precision = resolve_precision(precision_name, device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if precision.device.type == "cuda" else "gloo")
    try:
        values = _workload_args(args)
        workload = _build_workload(values, min(_MAX_BATCHES, args.warmup + args.rounds * args.steps + 2))
        log = _log if env_rank == 0 else (lambda _msg: None)
        log(f"workload: {workload.description}; precision {precision.name}")
        rows = run_comm_bench(
            workload, precision, comms, steps=args.steps, rounds=args.rounds, warmup=args.warmup, lr=args.lr, log=log
        )
        if env_rank == 0:
            description = f"{workload.description}; precision {precision.name}"
            table = format_comm_table(rows, dist.get_world_size(), description)
            if args.json:  # as the one-process bench: the document alone on stdout, the table on stderr
                print(table, file=sys.stderr)
                config = {"precision": precision.name, "steps": args.steps, "rounds": args.rounds}
                config |= {"warmup": args.warmup, "lr": args.lr}
                print(comm_to_json(rows, dist.get_world_size(), description, config), flush=True)
            else:
                print(table, flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.output:
        check_plot_file("--output", args.output)  # up front: not after the whole bench
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    measured_base = _measured_base(args.policy)
    if args.policy is not None and measured_base is None:
        try:  # a policy's own commas ("attention,norm") would be split by --precisions: its own flag
            precisions += (canonical_name(args.policy),)
        except ValueError as exc:
            raise CliError(f"--policy: {exc}") from None
    try:
        config = BenchConfig(
            precisions=precisions,
            steps=args.steps,
            rounds=args.rounds,
            warmup=args.warmup,
            lr=args.lr,
            measure_memory=not args.no_memory,
        )
    except ValueError as exc:
        raise CliError(str(exc).replace("BenchConfig.", "--")) from None  # the message names the flag

    values = _workload_args(args)
    num_batches = min(_MAX_BATCHES, config.warmup + config.rounds * config.steps)
    workload = _build_workload(values, num_batches)
    _log(f"workload: {workload.description}")
    notes: list[str] = []
    if measured_base is not None:
        report = _measure_policy(workload, measured_base)
        _log(report.explain())
        notes.append(f"--policy measured -> {report.policy} (per-op-kind timing: {report.elapsed_s:.2f} s)")
        if canonical_name(report.policy) not in {canonical_name(p) for p in config.precisions}:
            config.precisions = (*config.precisions, report.policy)
    result = run_bench(workload, config, log=_log)
    result.notes.extend(notes)
    if result.device == "cpu" and hasattr(os, "getloadavg"):
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if load > cores:
            result.notes.append(
                f"load average {load:.1f} on {cores} cores: other work shares this CPU, so the "
                "timings include its interference (the spread shows how much)"
            )
    table = format_table(result)
    if args.output:
        _log(f"chart written to {write_chart(result, args.output)}")
    if args.json:
        print(table, file=sys.stderr)
        print(to_json(result))
    else:
        print(table)
    return 0


COMMAND = Subcommand(
    name="bench",
    description="Benchmark the same model and data under several precisions, interleaved, in one process.",
    epilog=EPILOG,
    add_arguments=_add_arguments,
    run=run,
)
