"""accelerate's own test files, run unchanged and with only ``Accelerator`` taken from mixprec.

The issue's count (issue 22, "accelerate's own test files ... 24 of 45"): the test files of an accelerate
checkout that import ``Accelerator`` and have tests that run on a CPU in one process -- ``test_accelerator.py``
(26 run on a CPU), ``test_state_checkpointing.py`` (16), ``test_logging.py`` (2), ``test_optimizer.py`` (1) --
counted in tests: every test that is not skipped on this machine, 45 with accelerate 1.16 and the checkout's
HEAD 16cb6eb. Two more files are run and reported beside the count, not in it: ``test_kwargs_handlers.py``
(its 2 CPU tests build no Accelerator) and ``test_scheduler.py`` (9 tests, mostly two processes started by
accelerate's ``debug_launcher``).

The switch is what a user does to a script: ``from accelerate import Accelerator`` (or ``from
accelerate.accelerator import Accelerator``) becomes ``from mixprec import Accelerator``; every other name --
``PartialState``, ``AcceleratorState``, ``ProjectConfiguration``, the kwargs handlers, ``accelerate.test_utils``,
``accelerate.logging`` -- still comes from accelerate. Both stagings get one identical edit for version skew:
names the installed accelerate no longer exports (``FP8RecipeKwargs`` in 1.16) are dropped from their import line
(the tests that use them are GPU-only and skipped).

    python -m benchmarks.upstream_accelerate_tests --tests ~/src/accelerate/tests               # both, ~3 min
    python -m benchmarks.upstream_accelerate_tests --tests ~/src/accelerate/tests --impl mixprec

Needs ``pip install -e ".[test]" parameterized`` (the files import ``parameterized``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import shutil
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.upstream_hf_trainer import print_failures, run_pytest

COUNTED = ("test_accelerator.py", "test_state_checkpointing.py", "test_logging.py", "test_optimizer.py")
BESIDE = ("test_kwargs_handlers.py", "test_scheduler.py")  # run and reported, outside the 45
FILES = COUNTED + BESIDE
SWAPPED = {"accelerate", "accelerate.accelerator"}


def _exists(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def rewrite(text: str, swap: bool) -> str:
    """``text`` with ``Accelerator`` imported from mixprec when ``swap``, and names the installed accelerate
    lacks dropped from accelerate imports (both stagings)."""
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("accelerate")):
            continue
        names = [a.name for a in node.names]
        kept = [n for n in names if _exists(node.module, n) and not (swap and n == "Accelerator")]
        moved = swap and node.module in SWAPPED and "Accelerator" in names
        if kept == names:
            continue
        indent = " " * node.col_offset
        new = [f"{indent}from {node.module} import {', '.join(kept)}\n"] if kept else []
        if moved:
            new.append(f"{indent}from mixprec import Accelerator  # swapped from {node.module}\n")
        edits.append((node.lineno - 1, node.end_lineno, new))
    for start, end, new in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[start:end] = new
    return "".join(lines)


def stage(source: Path, into: Path, swap: bool) -> None:
    """Copy the tests folder into ``into``/tests (its data and helpers beside the counted files), rewriting the
    counted files."""
    tests = into / "tests"
    shutil.copytree(source, tests, ignore=shutil.ignore_patterns("__pycache__"))
    for name in FILES:
        path = tests / name
        path.write_text(rewrite(path.read_text(encoding="utf-8"), swap), encoding="utf-8")


def run(into: Path, timeout: int) -> dict[str, str]:
    """Run the staged files; ``{file::class::test: "pass" | "fail" | "skip"}``."""

    def prefix(case: ET.Element) -> str:
        parts = case.get("classname", "").split(".")
        return f"{parts[1] if len(parts) > 1 else parts[0]}::{parts[-1]}"

    return run_pytest(into, [f"tests/{n}" for n in FILES], timeout, prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True, help="an accelerate checkout's tests/ folder")
    parser.add_argument("--impl", choices=("both", "mixprec", "accelerate"), default="both")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per implementation")
    args = parser.parse_args(argv)
    missing = [n for n in FILES if not (args.tests / n).is_file()]
    if missing:
        parser.error(f"--tests {args.tests}: no {', '.join(missing)} there")
    impls = ("accelerate", "mixprec") if args.impl == "both" else (args.impl,)
    outcome = {}
    with tempfile.TemporaryDirectory(prefix="upstream_accelerate_") as tmp:
        for impl in impls:
            into = Path(tmp) / impl
            stage(args.tests, into, swap=impl == "mixprec")
            outcome[impl] = {n: r for n, r in run(into, args.timeout).items() if r != "skip"}
    for impl, results in outcome.items():
        counted = {n: r for n, r in results.items() if n.split("::")[0] + ".py" in COUNTED}
        passed = sum(r == "pass" for r in counted.values())
        print(f"{impl}: {passed}/{len(counted)} tests pass in {', '.join(COUNTED)} (those not skipped here)")
        for name in FILES:
            mine = [r for n, r in results.items() if n.split("::")[0] + ".py" == name]
            beside = "  (beside the count)" if name in BESIDE else ""
            print(f"  {name}: {mine.count('pass')}/{len(mine)}{beside}")
    print_failures(outcome, "accelerate", theirs=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
