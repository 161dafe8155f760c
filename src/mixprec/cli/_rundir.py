"""The run folder of ``mixprec train``: where it goes, how --resume finds it, and the flags saved in it.

A run folder holds ``config.toml`` (this run's flags, readable back with ``--config``; on ``--resume`` they
are the defaults, so ``mixprec train --resume DIR`` continues the same run), ``run.json`` (flags, model,
arguments, summary, sample), and what the Trainer writes: ``metrics.jsonl``, ``checkpoint-N/``, the plots
and ``train_summary.json``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
from pathlib import Path
from typing import Any

from mixprec.checkpoint import FolderInUseError, lock_folder
from mixprec.checkpoint.atomic import write_atomically
from mixprec.checkpoint.folders import trainer_folders
from mixprec.cli._config_file import apply_config_file, dump_toml, explicit_flags
from mixprec.cli.main import CliError
from mixprec.models import GPT_PRESETS
from mixprec.strategies.verdict import main_decides
from mixprec.trainer.callbacks import TrainerCallback

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


def resume_run_dir(resume: Any, output_dir: str | None) -> tuple[Path, Path | None]:
    """``(run_dir, checkpoint or None)`` that --resume names, from names alone (nothing is read or changed):
    True means --output-dir, or the newest run in runs/; a path is a run folder or one checkpoint-N in it."""
    if resume is True:
        if output_dir is not None:
            return Path(output_dir), None
        runs = sorted(p for p in Path(RUNS_DIR).glob("*") if trainer_folders(p).has_any())
        if not runs:
            raise CliError(f"--resume: no run with a checkpoint in {RUNS_DIR}/; pass --resume PATH or --output-dir")
        return runs[-1], None
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"--resume: no such run or checkpoint folder: {path}")
    if not path.is_dir():
        raise CliError(f"--resume {path}: a file, not a run folder or a checkpoint folder")
    if trainer_folders(path).has_any():
        run_dir, checkpoint = path, None
    elif trainer_folders(path.parent).number_of(path) is not None:
        run_dir, checkpoint = path.parent, path
    else:
        raise CliError(f"--resume {path}: neither a run folder with checkpoint-N folders nor a checkpoint folder")
    if output_dir is not None and Path(output_dir).resolve() != run_dir.resolve():
        raise CliError(f"--resume {path} and --output-dir {output_dir} name different runs; pass one of them")
    return run_dir, checkpoint


def resume_checkpoint(run_dir: Path, checkpoint: Path | None) -> Path | None:
    """The checkpoint to resume from, through the Trainer's one listing (call with the folder locked): a
    crash between a save's renames is recovered first; damaged checkpoints are skipped with a warning
    line naming them and why. CliError when none is left. On other processes than the main one: the named
    checkpoint or None (then the Trainer's resume_from_checkpoint=True finds the same one)."""
    if not is_main():  # the Trainer recovers on the main process, then every process lists after a barrier
        return checkpoint
    if checkpoint is not None:
        problem = trainer_folders(run_dir).verify(checkpoint)
        if problem is not None:
            raise CliError(
                f"--resume {checkpoint}: not a complete checkpoint ({problem}); pass the run folder "
                f"{checkpoint.parent} to resume from its newest intact checkpoint"
            )
        return checkpoint
    # warn=False: with no checkpoint left, the error line below says why, once (not also as a warning)
    found = trainer_folders(run_dir).find_resumable(warn=False)
    if found.checkpoint is None:
        why = "; ".join(f"{path.name}: {problem}" for path, problem in found.skipped)
        raise CliError(
            f"--resume: {run_dir} has no intact checkpoint-N folder to continue from" + (f" ({why})" if why else "")
        )
    if found.skipped:
        logging.getLogger("mixprec.checkpoint").warning("%s", found.describe_skipped())
    return found.checkpoint


def check_new_run_dir(run_dir: Path) -> None:
    """A fresh run's folder: not a file, not a run that has checkpoints already."""
    if run_dir.exists() and not run_dir.is_dir():
        raise CliError(f"--output-dir {run_dir} is a file, not a folder; choose a folder (it is created if needed)")
    if trainer_folders(run_dir).has_any():
        raise CliError(
            f"--output-dir {run_dir} already holds a run with checkpoints; continue it with --resume, "
            f"or choose another folder"
        )


def lock_run_dir(run_dir: Path) -> Any:
    """Create and lock the run folder on the main process (a no-op context elsewhere: the Trainer makes the
    processes agree). FolderInUseError names the process already running there, on every process under
    torchrun (the main one's verdict goes through the launcher's store, before any process group exists:
    mixprec.strategies.verdict), so none waits for a group the main process will never join."""
    import contextlib

    held = main_decides(
        f"lock:{os.path.realpath(run_dir)}",
        lambda: lock_folder(run_dir, what="run folder"),
        (FolderInUseError, OSError),
    )
    return held if held is not None else contextlib.nullcontext()


def check_printable_paths(args: argparse.Namespace) -> None:
    """Paths given on the command line must be valid text: a name that is not valid UTF-8 reaches Python as
    lone surrogates that no file (config.toml, run.json) can hold, so it is refused before anything runs."""
    for flag in ("output_dir", "data", "model", "config", "resume"):
        value = getattr(args, flag, None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raw = os.fsencode(value)
                raise CliError(
                    f"--{flag.replace('_', '-')} {raw!r}: the name is not valid UTF-8; rename it, or choose another"
                ) from None


def saved_flags(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "command", *_NOT_SAVED}
    flags = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
    # paths made absolute, so `--resume` or `--config <run>/config.toml` works from any directory
    for key in ("data", "model"):
        value = flags.get(key)
        if value is not None and Path(value).exists() and not (key == "model" and value in GPT_PRESETS):
            flags[key] = str(Path(value).resolve())
    return flags


def apply_saved_flags(args: argparse.Namespace, run_dir: Path) -> None:
    """On --resume, the run's own saved flags fill what neither the command line nor --config set."""
    path = run_dir / CONFIG_FILE
    keep = explicit_flags(args) | set(args._from_config_file)
    if "precision" in keep:  # a precision named now replaces the saved one, the kinds it kept in fp32 included
        keep.add("fp32_ops")
    if path.is_file():
        apply_config_file(args, path, keep=keep)


class SaveFlags(TrainerCallback):
    """Writes the run's ``config.toml`` when training begins, i.e. after a resume has loaded: a --resume that
    fails (a wrong --model, a damaged checkpoint) leaves the file as it was, so the documented resume
    command still works (issue 14, fault 5). Written atomically, main process only."""

    def __init__(self, run_dir: Path, flags: dict[str, Any]) -> None:
        self.path = run_dir / CONFIG_FILE
        header = "mixprec train flags of this run; reuse with: mixprec train --config <this file>"
        self.text = dump_toml(flags, header=header)

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - the callback signature
        if is_main() and state.global_step < state.max_steps:  # a resume past the end keeps the run's flags
            write_atomically(self.path, lambda p: Path(p).write_text(self.text, encoding="utf-8"))
