"""`mixprec`: the command line. One file per subcommand; this file only dispatches.

Each subcommand module holds one :class:`~mixprec.cli._subcommand.Subcommand`, ``COMMAND`` (its flags, what
it runs, and examples in its ``--help`` epilog). Errors a user can fix (:class:`CliError`, ValueError, a
damaged checkpoint, a folder in use by another run, a file or folder that cannot be read or written, a full
disk) become one line on stderr naming the file or flag and what to do, and exit code 2 — never a traceback
(set MIXPREC_DEBUG=1 to see one). Library warnings (a checkpoint skipped as damaged, a resume into another
precision) are printed on stderr as ``mixprec: warning: ...`` lines.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from mixprec import __version__
from mixprec.cli import torchrun  # torch-free at import: torch's launcher loads when it runs

# subcommand -> module; imported only when that subcommand runs (the modules import torch, which takes
# seconds), so `mixprec --help` stays fast; and the one line each is listed with, registered or not
SUBCOMMANDS: dict[str, str] = {
    "train": "mixprec.cli.train",
    "diagnose": "mixprec.cli.diagnose",
    "bench": "mixprec.cli.bench",
    "export": "mixprec.cli.export",
    "replay": "mixprec.cli.replay",
}
SUMMARIES: dict[str, str] = {
    "train": "train a model (default: the built-in GPT on the embedded corpus) and report what precision did",
    "diagnose": "see fp16/bf16 underflow and overflow per layer, and the loss scale to start from",
    "bench": "time fp32, fp16, bf16 and auto on the same model: step time, tokens/s, memory, loss, MFU",
    "export": "write a sharded FSDP2 checkpoint's full weights to one safetensors file",
    "replay": "re-run a bad step from its capsule in fp32 and the run's precision; name the first module apart",
}

# `mixprec torchrun ARGS` is torch's launcher with torch's own parser (mixprec.cli.torchrun): its arguments
# are passed through untouched, so it is dispatched before argparse sees them
TORCHRUN = "torchrun"
TORCHRUN_SUMMARY = "torch's torchrun (same arguments): exit 143 on SIGTERM, restarts safe on several nodes"

EPILOG = """\
examples:
  mixprec train                         train the built-in GPT on the embedded corpus (precision auto)
  mixprec train --precision fp16 --max-steps 200
  mixprec diagnose                      how much of the gradients fp16 would flush to zero
  mixprec bench --steps 5               fp32, fp16, bf16 and auto side by side
  mixprec export runs/x/sharded model.safetensors   a sharded FSDP2 checkpoint as one file
  mixprec replay runs/x/capsules/step-00000412   the first module a bad step went wrong in (--watch's capsules)
  mixprec torchrun --nproc_per_node=2 --max-restarts=3 -m mixprec.cli.main train --output-dir runs/x
                                        torch's torchrun, ending with 143 on SIGTERM (see its docstring)
  mixprec <command> --help              flags and examples for one command
"""


class CliError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming the flag and the fix, as every other bad input is
    (issue 29: ``--batch-size 0`` printed the 8-line usage block first); --help still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser with ``commands`` fully registered (default: all); the others are listed by name only."""
    parser = _OneLineParser(
        prog="mixprec",
        description="Mixed-precision training for PyTorch that works as written, on CPU and GPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module in SUBCOMMANDS.items():
        if commands is None or name in commands:
            importlib.import_module(module).COMMAND.register(subparsers, SUMMARIES[name])
        else:
            subparsers.add_parser(name, help=SUMMARIES[name], add_help=False)
    subparsers.add_parser(TORCHRUN, help=TORCHRUN_SUMMARY, add_help=False)  # main() hands it its arguments
    return parser


def _command_in(argv: Sequence[str]) -> list[str]:
    """The subcommand named on the command line, if any (the first word that is one)."""
    return [word for word in argv if word in SUBCOMMANDS][:1]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [TORCHRUN]:
        return torchrun.main(argv[1:])
    parser = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    _warnings_to_stderr()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, OSError, *_user_errors()) as exc:
        if os.environ.get("MIXPREC_DEBUG"):  # developers: see the traceback
            raise
        print(f"mixprec {args.command}: error: {describe_error(exc)}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors about the user's files rather than mixprec's code: a damaged checkpoint, a folder in use, a
    peer that died or went silent (one line naming it)."""
    # deferred (start-up): both packages import torch, which `mixprec --help` must not wait for; only the
    # error path pays for them
    from mixprec.checkpoint import CheckpointError, FolderInUseError
    from mixprec.strategies.peers import PeerLostError  # deferred (start-up), as the line above

    return (CheckpointError, FolderInUseError, PeerLostError)


_ADVICE = {
    errno.EACCES: "choose a folder you can write to (--output-dir) or fix its permissions",
    errno.EPERM: "choose a folder you can write to (--output-dir) or fix its permissions",
    errno.EROFS: "the filesystem is read-only; choose a writable folder with --output-dir",
    errno.ENOSPC: "the disk is full; free space, then resume with --resume",
    errno.EEXIST: "a file of that name is in the way; move it or choose another --output-dir",
    errno.ENOTDIR: "a file of that name is in the way; move it or choose another --output-dir",
    errno.EISDIR: "a folder was given where a file is expected",
}


def describe_error(exc: BaseException) -> str:
    """One line for the user: the message, or for an operating-system error the file, what failed and what
    to do ("/runs/x/config.toml: permission denied; choose a folder you can write to ...")."""
    if isinstance(exc, OSError) and exc.strerror and type(exc).__str__ is OSError.__str__:
        where = exc.filename if exc.filename is not None else "a file"
        advice = _ADVICE.get(exc.errno or 0)
        return f"{where}: {exc.strerror[:1].lower()}{exc.strerror[1:]}" + (f"; {advice}" if advice else "")
    text = " ".join(str(exc).split())  # one line, whatever the message held
    return text or type(exc).__name__


class _StderrHandler(logging.Handler):
    """Writes each record as one ``mixprec: warning: ...`` line to whatever ``sys.stderr`` is at that record (a
    redirected or captured stderr included)."""

    _mixprec_cli = True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"mixprec: {record.levelname.lower()}: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a failed record is reported, never raised
            self.handleError(record)


def _warnings_to_stderr() -> None:
    """Show mixprec's library warnings on stderr, each as one ``mixprec: warning: ...`` line (once)."""
    root = logging.getLogger("mixprec")
    if not any(getattr(h, "_mixprec_cli", False) for h in root.handlers):
        root.addHandler(_StderrHandler(logging.WARNING))


if __name__ == "__main__":  # pragma: no cover - `python -m mixprec.cli.main`, the form torchrun takes
    # Run the copy in mixprec.cli.main, not this __main__ one: subcommands raise mixprec.cli.main.CliError,
    # which a second copy of the class would not catch (bad input would show a traceback).
    from mixprec.cli.main import main as _main

    sys.exit(_main())
