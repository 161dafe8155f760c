"""The run folder of ``mixprec train``: where it goes, how --resume finds it, and the flags saved in it.

A run folder holds ``config.toml`` (this run's flags, readable back with ``--config``; on ``--resume`` they
are the defaults, so ``mixprec train --resume DIR`` continues the same run), ``run.json`` (flags, model,
arguments, summary, sample), and what the Trainer writes: ``metrics.jsonl``, ``checkpoint-N/``, the plots
and ``train_summary.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

from mixprec.cli._config import apply_config_file, explicit_flags
from mixprec.cli.main import CliError
from mixprec.models import GPT_PRESETS

RUNS_DIR = "runs"
"""Parent of the default run folders (runs/<date>-<time>), relative to the working directory."""

CONFIG_FILE = "config.toml"
RUN_FILE = "run.json"
# flags that describe this invocation, not the run: never saved into (or read back from) the run's config
_NOT_SAVED = ("config", "resume", "output_dir")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def launch_time() -> datetime.datetime:
    """When this run was launched, the same on every process of a torchrun launch.

    Each process's own clock differs by a second or so, which would give each its own folder; torchrun's
    workers share their parent (the launcher's agent), so its start time names the run (Linux /proc).
    """
    if world_size() == 1:
        return datetime.datetime.now()
    try:
        ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return datetime.datetime.fromtimestamp(btime + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        raise CliError(
            "under torchrun, pass --output-dir so that every process writes to the same run folder"
        ) from None


def new_run_dir() -> Path:
    stamp = launch_time().strftime("%Y%m%d-%H%M%S")
    path = Path(RUNS_DIR) / stamp
    if world_size() == 1:  # a second run in the same second gets its own folder (one process decides alone)
        n = 1
        while path.exists():
            n += 1
            path = Path(RUNS_DIR) / f"{stamp}-{n}"
    return path


def checkpoints_of(run_dir: Path) -> list[Path]:
    from mixprec.trainer.checkpointing import list_checkpoints

    return list_checkpoints(run_dir)


def resolve_resume(resume: Any, output_dir: str | None) -> tuple[Path, Path]:
    """``(run_dir, checkpoint)`` for --resume (True: the last checkpoint of --output-dir or the newest run)."""
    if resume is True:
        if output_dir is not None:
            run_dir = Path(output_dir)
        else:
            runs = sorted(p for p in Path(RUNS_DIR).glob("*") if p.is_dir() and checkpoints_of(p))
            if not runs:
                raise CliError(f"--resume: no run with a checkpoint in {RUNS_DIR}/; pass --resume PATH or --output-dir")
            run_dir = runs[-1]
    else:
        path = Path(resume)
        if not path.exists():
            raise FileNotFoundError(f"--resume: no such run or checkpoint folder: {path}")
        if checkpoints_of(path):
            run_dir = path
        elif path.is_dir() and path.parent != path and path in checkpoints_of(path.parent):
            return path.parent, path
        else:
            raise CliError(f"--resume {path}: neither a run folder with checkpoint-N folders nor a checkpoint folder")
        if output_dir is not None and Path(output_dir).resolve() != run_dir.resolve():
            raise CliError(f"--resume {path} and --output-dir {output_dir} name different runs; pass one of them")
    checkpoints = checkpoints_of(run_dir)
    if not checkpoints:
        raise CliError(f"--resume: {run_dir} has no checkpoint-N folder to continue from")
    return run_dir, checkpoints[-1]


def saved_flags(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "command", *_NOT_SAVED}
    flags = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
    # paths made absolute, so `--resume` or `--config <run>/config.toml` works from any directory
    for key in ("data", "model"):
        if (
            flags.get(key) is not None
            and Path(flags[key]).exists()
            and not (key == "model" and flags[key] in GPT_PRESETS)
        ):
            flags[key] = str(Path(flags[key]).resolve())
    return flags


def apply_saved_flags(args: argparse.Namespace, run_dir: Path) -> None:
    """On --resume, the run's own saved flags fill what neither the command line nor --config set."""
    path = run_dir / CONFIG_FILE
    if path.is_file():
        apply_config_file(args, path, keep=explicit_flags(args) | set(args._from_config_file))
