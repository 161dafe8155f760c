"""``.. mixprec-diff:: BEFORE AFTER``: the unified diff of two example scripts (paths from the repository root),
code only: each file's module docstring (which says "before" or "after") is left out, and the headers name the
files as a reader finds them in the repository, not where the build ran."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx

ROOT = Path(__file__).resolve().parents[2]


def code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring."""
    text = path.read_text()
    tree = ast.parse(text)
    first = tree.body[0]
    skip = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    return text.splitlines(keepends=True)[skip:]


class ExampleDiff(Directive):
    required_arguments = 2

    def run(self) -> list[nodes.Node]:
        env = self.state.document.settings.env
        before, after = self.arguments
        for name in (before, after):
            env.note_dependency(str(ROOT / name))
        diff = "".join(difflib.unified_diff(code_lines(ROOT / before), code_lines(ROOT / after), before, after))
        block = nodes.literal_block(diff, diff)
        block["language"] = "diff"
        return [block]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("mixprec-diff", ExampleDiff)
    return {"parallel_read_safe": True, "version": "1"}
