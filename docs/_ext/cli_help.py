"""``.. mixprec-help:: COMMAND``: a subcommand's ``--help``, exactly as ``mixprec COMMAND --help`` prints it.

The text comes from the parser itself (``mixprec.cli.main.build_parser``), so the page cannot drift from the
flags; the examples in each subcommand's epilog are shown as written (a literal block), which an argparse-to-
reStructuredText renderer would reflow.
"""

from __future__ import annotations

import argparse
import os

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx


def help_text(command: str) -> str:
    """``mixprec --help`` for ``""``, else ``mixprec COMMAND --help``, at a fixed width of 100 columns."""
    from mixprec.cli.main import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; a page must not depend on it
    parser = build_parser([command] if command else None)
    if not command:
        return parser.format_help()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


class MixprecHelp(Directive):
    required_arguments = 0
    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        command = self.arguments[0] if self.arguments else ""
        text = help_text(command)
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("mixprec-help", MixprecHelp)
    return {"parallel_read_safe": True, "version": "1"}
