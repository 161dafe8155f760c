"""The code reads one way: ruff's formatter at one line length (pyproject's [tool.ruff]), its lint rules, and
no formatter exception without a reason (issue 35: a ``# fmt: skip`` or ``# fmt: off`` needs a comment saying why
on the line above). The formatter's output changes between releases, so the test extra pins ruff's version."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ["src", "tests", "benchmarks", "examples", "docs", "tools"]
RUFF = [sys.executable, "-m", "ruff"]
needs_ruff = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff is in the test extra: pip install -e '.[test]'"
)


@needs_ruff
def test_the_code_is_as_ruff_formats_it():
    run = subprocess.run([*RUFF, "format", "--check", *CODE], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"run `ruff format {' '.join(CODE)}`:\n{run.stdout}{run.stderr}"


@needs_ruff
def test_ruff_finds_nothing():
    run = subprocess.run([*RUFF, "check", *CODE], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_formatter_exception_says_why():
    unexplained = []
    for path in sorted(p for folder in CODE for p in (ROOT / folder).rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"#\s*fmt:\s*(skip|off)", line) and path.name != "test_style.py":
                above = lines[i - 1].strip() if i else ""
                if not (above.startswith("#") and "fmt:" not in above):
                    unexplained.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not unexplained, f"a formatter exception without a reason on the line above: {unexplained}"
