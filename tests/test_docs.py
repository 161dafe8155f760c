"""The documentation site (docs/): it builds with warnings as errors, and every public name has a page.

The build is the one a user runs (``python -m sphinx -W -n -b html docs docs/_build/html``), in a subprocess
and into a temporary folder; it is skipped only where the ``docs`` extra (sphinx, furo, myst-parser) is absent.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mixprec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DIRECTIVE = re.compile(r"^\.\. (?:auto(?:class|function|exception|data)|py:data)::\s+(mixprec\.[\w.]+)", re.M)


def documented_names() -> set[str]:
    """Every ``mixprec.X`` an API page documents with an autodoc (or py:data) directive."""
    names: set[str] = set()
    for page in (DOCS / "api").glob("*.rst"):
        names.update(DIRECTIVE.findall(page.read_text()))
    return names


def test_every_public_name_has_a_reference_entry() -> None:
    public = {f"mixprec.{name}" for name in mixprec.__all__}
    missing = sorted(public - documented_names())
    assert not missing, f"public names without an entry in docs/api/*.rst: {missing}"


def test_reference_pages_name_only_what_exists() -> None:
    # a page that documents a name mixprec no longer has would fail the build too; this says which, quickly
    stale = []
    for name in sorted(documented_names()):
        module, _, attr = name.rpartition(".")
        try:
            obj = importlib.import_module(module)
        except ImportError:
            obj = getattr(importlib.import_module(module.rpartition(".")[0]), module.rpartition(".")[2], None)
        if obj is None or not hasattr(obj, attr):
            stale.append(name)
    assert not stale, f"docs/api/*.rst document names that do not exist: {stale}"


def _field_docstrings(cls: type) -> set[str]:
    """Names of the fields that carry a docstring right under them, in the source of cls and its bases."""
    out: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("mixprec"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, after in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                out.add(stmt.target.id)
    return out


def test_every_training_argument_is_described() -> None:
    # mixprec's fields by a docstring under each (autodoc shows it); HF's other fields by their metadata help,
    # which the reference's table shows (and HfArgumentParser prints as each flag's help)
    documented = _field_docstrings(mixprec.TrainingArguments)
    bare = [
        f.name
        for f in dataclasses.fields(mixprec.TrainingArguments)
        if f.name not in documented and not f.metadata.get("help")
    ]
    assert not bare, f"TrainingArguments fields with no docstring: {bare}"


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    for module in ("sphinx", "furo", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    problems = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0, "\n".join(problems or done.stderr.splitlines()[-20:])
    assert (tmp_path / "index.html").is_file() and (tmp_path / "api" / "training_arguments.html").is_file()
    empty = empty_reference_entries(tmp_path)
    assert not empty, f"reference entries that say nothing (a member with no docstring): {empty}"


# an autodoc entry: its signature (<dt id="mixprec....">) and its description (<dd>...</dd>)
ENTRY = re.compile(r'<dt class="sig[^"]*" id="(mixprec\.[^"]+)">.*?</dt>\s*<dd>(.*?)</dd>', re.S)


def empty_reference_entries(html: Path) -> list[str]:
    """The entries of the built reference (html/api/*.html) whose description is empty: a member without a
    docstring shows as a bare signature. A constructor's separated signature (``__init__``) has none by design:
    the class's docstring above it describes it."""
    return [
        name
        for page in sorted((html / "api").glob("*.html"))
        for name, body in ENTRY.findall(page.read_text())
        if not re.sub(r"<[^>]+>", "", body).strip() and not name.endswith(".__init__")
    ]


# -- the guides' code blocks ------------------------------------------------------------------------------
# Every code block in a guide is an example file included verbatim ({literalinclude}, {mixprec-diff}: the
# build fails if the file is gone), or a shell block whose commands are checked here: `mixprec` commands
# parse with the real parser, example scripts and benchmark modules exist and take the flags used.

FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.M | re.S)
INCLUDED = {"{literalinclude}", "{mixprec-diff}", "{toctree}"}


def guide_blocks() -> list[tuple[str, str, str]]:
    """(page, fence info, body) of every fenced block in docs/*.md and docs/guides/."""
    pages = [*DOCS.glob("*.md"), *(DOCS / "guides").rglob("*.md")]
    return [
        (str(page.relative_to(DOCS)), info, body)
        for page in pages
        if page.name != "ARCHITECTURE.md"
        for info, body in FENCE.findall(page.read_text())
    ]


def shell_commands() -> list[tuple[str, list[str]]]:
    import shlex

    out = []
    for page, info, body in guide_blocks():
        if info == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith("#"):
                    out.append((page, shlex.split(line)))
    return out


def test_guide_code_blocks_are_included_files_or_shell_commands() -> None:
    other = [(page, info) for page, info, _ in guide_blocks() if info not in INCLUDED | {"bash"}]
    assert not other, f"code blocks neither included from examples/ nor checked shell commands: {other}"


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def _check_script(script: Path, args: list[str], where: str) -> None:
    assert script.is_file(), f"{where}: {script.relative_to(ROOT)} does not exist"
    source = script.read_text()
    unknown = [flag for flag in _flags(args) if f'"{flag}"' not in source]
    assert not unknown, f"{where}: {script.relative_to(ROOT)} takes no {unknown}"


@pytest.mark.parametrize("page,words", shell_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_guide_shell_command_is_valid(page: str, words: list[str]) -> None:
    from mixprec.cli.main import build_parser

    where = f"{page}: {' '.join(words)}"
    if words[:2] == ["mixprec", "torchrun"] or words[0] == "torchrun":
        launcher = words[2:] if words[0] == "mixprec" else words[1:]
        target = next(i for i, w in enumerate(launcher) if not w.startswith("--"))
        if launcher[target] == "-m":
            assert launcher[target + 1] == "mixprec.cli.main", where
            words = ["mixprec", *launcher[target + 2 :]]
        else:
            return _check_script(ROOT / launcher[target], launcher[target + 1 :], where)
    if words[0] == "mixprec":
        try:
            build_parser(words[1:2]).parse_args(words[1:])
        except SystemExit as exit_:
            pytest.fail(f"{where}: the parser refuses it (exit {exit_.code})")
    elif words[:2] == ["python", "-m"]:
        module = words[2]
        assert module.startswith("benchmarks."), where
        _check_script(ROOT / (module.replace(".", "/") + ".py"), words[3:], where)
    elif words[0] == "python":
        _check_script(ROOT / words[1], words[2:], where)
    else:
        pytest.fail(f"{where}: not a command this test knows how to check")


def test_readme_links_into_the_site_exist() -> None:
    links = re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)\)", (ROOT / "README.md").read_text())
    assert links, "the README links into the documentation site"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_public_name_has_a_docstring() -> None:
    # autodoc shows an entry without a docstring as a bare signature: the reference would say nothing
    bare = [name for name in mixprec.__all__ if name != "__version__" and not inspect.getdoc(getattr(mixprec, name))]
    assert not bare, f"public names without a docstring: {bare}"
