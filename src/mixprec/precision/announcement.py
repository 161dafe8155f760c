"""The run's one line about its precision, said by the precision itself (issue 29: one story per run).

The caller that knows the rest of the run (the Accelerator: its distribution, comm dtype, whether it prints)
hands that down once as :class:`RunContext`, a value, at ``Precision.configure``; the precision says its line
through the ``mixprec`` logger when the run is set up (``Precision.announce``), and a mode still to be decided
("auto") says it again once it has decided.
Nothing is called back up: the precision owns its facts (``describe()``) and now the moment it knows them.
"""

from __future__ import annotations

import builtins
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("mixprec.accelerator")  # the run's start-up line has always been the Accelerator's


@dataclass(frozen=True)
class RunContext:
    """What surrounds the precision in this run, as text the precision puts in its line."""

    processes: str = "1 process"
    """The distribution, as the strategy describes it ("1 process", "DDP over 2 processes (gloo)", ...)."""
    comm: str = ""
    """The gradients' wire dtype where it is not the compute's ("" for none)."""
    extra: str = ""
    """Anything more the run does that bears on precision ("" for none)."""
    is_main: bool = True
    """Only the main process says the full line."""
    verbose: bool = False
    """Print the line on stderr too (the Accelerator's ``verbose``)."""


def announce(d: Mapping[str, Any], pending: bool, context: RunContext) -> None:
    """Log what this run is (``d``: the precision's ``describe()``; the device, the distribution, the comm
    dtype), once; printed too with ``verbose``. A ``pending`` "auto" says only that it will decide; it calls
    this again once decided. No host sync."""
    if pending:
        logger.info("mixprec: auto on %s, %s: %s", d["device"], context.processes, d["reason"])
        return
    line = (
        f"mixprec: {d['precision']} on {d['device']} (compute {d['compute_dtype']}, master weights "
        f"{d['param_dtype']}, loss scaling {'on' if d['loss_scaling'] else 'off'}), "
        f"{context.processes}{', ' + context.comm if context.comm else ''}: {d['reason']}{context.extra}"
    )
    if context.is_main:
        logger.info(line)
        if context.verbose:
            _print_line(line)


def _print_line(line: str) -> None:
    """``line`` on stderr on a line of its own: through tqdm when one of its bars is drawn on the terminal
    (it clears the bar, prints, redraws), else a plain print (the Trainer draws no bar into a file)."""
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if bars:
        tqdm.tqdm.write(line, file=sys.stderr)  # type: ignore[union-attr]
        sys.stderr.flush()
    else:
        builtins.print(line, file=sys.stderr, flush=True)
