"""The `mixprec` command as a whole: the subcommand list, each --help with examples that parse, no traceback."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from mixprec.cli.main import build_parser, main
from mixprec.cli.train import EPILOG as TRAIN_EPILOG

TRAIN_FLAGS = (
    "--precision",
    "--data",
    "--model",
    "--epochs",
    "--max-steps",
    "--batch-size",
    "--seq-len",
    "--lr",
    "--output-dir",
    "--resume",
    "--compile",
    "--seed",
    "--config",
    "--diagnose",
)


def test_mixprec_help_lists_the_train_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "mixprec train" in out


def test_no_arguments_prints_the_help_and_succeeds(capsys):
    assert main([]) == 0
    assert "<command>" in capsys.readouterr().out


def test_train_help_has_every_flag_and_runnable_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in TRAIN_FLAGS:
        assert flag in out, flag
    assert "examples:" in out and "torchrun --nproc_per_node=2" in out


def _train_examples() -> list[list[str]]:
    """The `mixprec train ...` commands of the help text (an example is followed by two spaces and its
    description)."""
    lines = [line.strip() for line in TRAIN_EPILOG.splitlines()]
    return [shlex.split(re.split(r"\s{2,}", line)[0])[1:] for line in lines if line.startswith("mixprec train")]


def test_every_train_example_in_the_help_parses():
    examples = _train_examples()
    assert len(examples) >= 6
    parser = build_parser()
    for argv in examples:
        args = parser.parse_args(argv)  # SystemExit (a failed test) on any flag the parser does not know
        assert args.command == "train"


@pytest.mark.parametrize("module", ["mixprec.cli.main", "mixprec"])
def test_python_dash_m_bad_input_has_no_traceback(tmp_path, module):
    # `python -m` is the form torchrun launches: its errors must be one line too
    proc = subprocess.run(
        [sys.executable, "-m", module, "train", "--precision", "fp17"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mixprec train: error: --precision: unknown precision")


def test_unknown_subcommand_is_an_error_without_traceback(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trian"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'trian'" in err and "Traceback" not in err


def test_top_level_help_lists_every_subcommand_without_importing_torch():
    # the subcommand modules import torch (seconds); `mixprec --help` must not wait for it
    code = (
        "import sys, contextlib, io\n"
        "from mixprec.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(out.getvalue())\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.splitlines()[-1] == "torch imported: False"
    for name in ("train", "diagnose", "bench"):
        assert f"    {name} " in proc.stdout


@pytest.mark.parametrize("command", ["replay", "export"])
def test_help_of_a_subcommand_that_reads_a_file_does_not_wait_for_torch(command: str) -> None:
    # replay and export defer their one heavy import into run() (tests/test_layers.py counts such imports):
    # their --help answers without loading torch
    code = (
        "import sys, contextlib, io\n"
        "from mixprec.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        f"    main([{command!r}, '--help'])\n"
        "print('examples:' in out.getvalue(), 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.split() == ["True", "False"]


def test_mixprec_torchrun_hands_its_arguments_to_torchs_launcher_untouched(monkeypatch) -> None:
    import mixprec.cli.torchrun as launcher

    seen: list[list[str]] = []
    monkeypatch.setattr(launcher, "main", lambda argv: seen.append(list(argv)) or 0)
    argv = ["torchrun", "--nproc_per_node=2", "--max-restarts=3", "-m", "mixprec.cli.main", "train", "--help"]
    assert main(argv) == 0
    assert seen == [argv[1:]]  # nothing parsed by mixprec's own parser (train's --help included)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["train", "--batch-size", "0"], "--batch-size"),
        (["train", "--lr", "-1"], "--lr"),
        (["train", "--epochs", "0"], "--epochs"),
        (["train", "--max-steps", "-5"], "--max-steps"),
        (["bench", "--steps", "0"], "--steps"),
        (["train", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_without_the_usage_block(capsys, argv, flag):
    # issue 29: numeric flag errors printed argparse's 8-line usage block before the message
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and flag in err and "usage:" not in err
    assert "--help" in err


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_mixprec_torchrun_refuses_a_bad_process_count_in_one_line(value, capsys) -> None:
    # issue 34: torch's launcher ended --nproc-per-node 0 in an AssertionError traceback
    assert main(["torchrun", "--nproc-per-node", value, "-m", "mixprec.cli.main", "train"]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mixprec torchrun: error: --nproc-per-node {value}: expected ") and "Traceback" not in err
