"""What every ``mixprec`` subcommand is (after torchtune's ``_cli/``): one file per subcommand, each holding
one :class:`Subcommand` named ``COMMAND`` that says what the dispatcher needs — its name, description,
runnable examples (the ``--help`` epilog), its flags and what it runs. ``cli/main.py`` imports a subcommand's
file only when that subcommand runs, and calls ``COMMAND.register(subparsers, summary)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """A ``mixprec <name>`` subcommand. ``register`` adds its parser (the examples shown verbatim under
    ``--help``) with ``run`` as the function ``main`` calls on the parsed arguments."""

    name: str
    description: str
    """The first line of its own ``--help``."""
    epilog: str
    """Runnable examples, one a line, each with what it does."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's flags to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it; returns the exit code. Raises CliError (one line, exit 2) for input the user can fix."""

    def register(self, subparsers: argparse._SubParsersAction, summary: str) -> argparse.ArgumentParser:
        """Add this subcommand's parser to ``subparsers``, listed there with the one line ``summary``; return it."""
        parser = subparsers.add_parser(
            self.name,
            help=summary,
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        parser.set_defaults(func=self.run)
        return parser
