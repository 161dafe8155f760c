"""transformers' own Trainer tests, run unchanged and with only their import lines switched to mixprec.

The issue's count: ``tests/trainer/test_trainer.py`` (the core file) and ``tests/trainer/test_trainer_callback.py``
of a transformers checkout, with ``trainer_test_utils.py`` beside them, run on the CPU with the Hub offline;
the callback file's SwanLab/Kubeflow integration tests are left out of the count (they test those
integrations, not the Trainer): 61 tests. Nothing is downloaded; tests that need the Hub fail under both.

The switch is what a user does to a script: every ``from transformers import ...`` /
``from transformers.trainer_callback import ...`` loses the names mixprec exports (``mixprec.__all__``) and
a ``from mixprec import <those names>`` takes their place. Nothing else in the files changes, so the tests
still use transformers' models, datasets, test utilities and loggers.

    python -m benchmarks.upstream_hf_trainer --tests ~/src/transformers/tests          # both, ~2 min
    python -m benchmarks.upstream_hf_trainer --tests ~/src/transformers/tests --impl mixprec

Needs ``pip install -e ".[test]" parameterized pytest-timeout`` (the files import ``parameterized``).
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection
from pathlib import Path

FILES = ("test_trainer.py", "test_trainer_callback.py", "trainer_test_utils.py")
MODULES = {"transformers", "transformers.trainer_callback"}
NOT_COUNTED = ("SwanLab", "Kubeflow")  # integration tests in the callback file, outside the 61
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}


def swap_imports(text: str, exported: set[str], modules: Collection[str] = MODULES) -> tuple[str, list[str]]:
    """``text`` with the names in ``exported`` imported from mixprec instead of from ``modules``; and those
    names. Only top-level-module imports (``from transformers import X``) move, wherever they are in the file."""
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0):
            continue
        names = [a.name for a in node.names]
        moved = [n for n in names if n in exported]
        if not moved:
            continue
        kept = [n for n in names if n not in exported]
        indent = " " * node.col_offset
        new = [f"{indent}from {node.module} import {', '.join(kept)}\n"] if kept else []
        new.append(f"{indent}from mixprec import {', '.join(moved)}  # swapped from {node.module}\n")
        edits.append((node.lineno - 1, node.end_lineno, new, moved))
    swapped: list[str] = []
    for start, end, new, moved in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[start:end] = new
        swapped += moved
    return "".join(lines), sorted(set(swapped))


def stage(source: Path, into: Path, swap: bool) -> None:
    """Copy the three files into ``into``/tests/trainer (a folder named tests: transformers' get_tests_dir()
    walks up to one), switching the imports when ``swap``."""
    import mixprec

    exported = set(mixprec.__all__) - {"__version__"}
    trainer = into / "tests" / "trainer"
    trainer.mkdir(parents=True)
    (into / "tests" / "__init__.py").write_text("")
    (trainer / "__init__.py").write_text("")
    for name in FILES:
        text = (source / "trainer" / name).read_text(encoding="utf-8")
        if swap:
            text, _ = swap_imports(text, exported)
        (trainer / name).write_text(text, encoding="utf-8")


def run(into: Path, timeout: int) -> dict[str, str]:
    """Run the staged tests; ``{class::test: "pass" | "fail" | "skip"}``."""
    return run_pytest(into, ["tests/trainer"], timeout, lambda case: case.get("classname", "").split(".")[-1])


def run_pytest(into: Path, paths: list[str], timeout: int, prefix: Callable[[ET.Element], str]) -> dict[str, str]:
    """Run pytest on ``paths`` (relative to ``into``) offline, read its JUnit report: ``{prefix(case)::test:
    "pass" | "fail" | "skip"}`` (both upstream-test harnesses)."""
    report = into / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, f"--junitxml={report}"]
    env = {**os.environ, **OFFLINE}
    subprocess.run(cmd, cwd=into, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        name = f"{prefix(case)}::{case.get('name')}"
        results[name] = "fail" if tags & {"failure", "error"} else "skip" if "skipped" in tags else "pass"
    return results


def counted(results: dict[str, str]) -> dict[str, str]:
    return {n: r for n, r in results.items() if r != "skip" and not any(k in n for k in NOT_COUNTED)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True, help="a transformers checkout's tests/ folder")
    parser.add_argument("--impl", choices=("both", "mixprec", "transformers"), default="both")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per implementation")
    args = parser.parse_args(argv)
    missing = [n for n in FILES if not (args.tests / "trainer" / n).is_file()]
    if missing:
        parser.error(f"--tests {args.tests}: no trainer/{', trainer/'.join(missing)} there")
    impls = ("transformers", "mixprec") if args.impl == "both" else (args.impl,)
    outcome = {}
    with tempfile.TemporaryDirectory(prefix="upstream_hf_") as tmp:
        for impl in impls:
            into = Path(tmp) / impl
            stage(args.tests, into, swap=impl == "mixprec")
            outcome[impl] = counted(run(into, args.timeout))
    for impl, results in outcome.items():
        passed = sorted(n for n, r in results.items() if r == "pass")
        print(f"{impl}: {len(passed)}/{len(results)} pass")
    print_failures(outcome, "transformers")
    return 0


def print_failures(outcome: dict[str, dict[str, str]], upstream: str, *, theirs: bool = False) -> None:
    """The failures of a two-implementation run, split: under both, under mixprec only (and, with ``theirs``,
    under ``upstream`` only); of a one-implementation run, all of them. ``outcome``: impl -> test -> result."""
    if len(outcome) != 2:
        failed = sorted(n for results in outcome.values() for n, r in results.items() if r == "fail")
        print("failed:", *failed, sep="\n  ")
        return
    up, mp = outcome[upstream], outcome["mixprec"]
    both = sorted(n for n in up if up[n] == "fail" and mp.get(n) == "fail")
    only = sorted(n for n in mp if mp[n] == "fail" and up.get(n) == "pass")
    print(f"fail under both ({len(both)}):", *both, sep="\n  ")
    print(f"fail under mixprec only ({len(only)}):", *only, sep="\n  ")
    if theirs:
        other = sorted(n for n in up if up[n] == "fail" and mp.get(n) == "pass")
        print(f"fail under {upstream} only ({len(other)}):", *other, sep="\n  ")


if __name__ == "__main__":
    raise SystemExit(main())
