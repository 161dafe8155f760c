"""torchao, the optional dependency behind the memory-lean modes (fp8 training, 8/4-bit optimizer states).

mixprec imports without it; the modes that need it import it here, on first use, so a missing or too old
torchao is one line that says what to install, wherever it is asked for (a precision name, an ``optim``
name, the command line).
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from mixprec.precision.base import PrecisionNotSupportedError

LEAN_INSTALL = 'pip install "mixprec[lean]"'
MIN_VERSION = (0, 18)


class MissingExtraError(ValueError, ImportError):
    """An optional dependency a requested feature needs is absent. A ValueError too, so the command line
    prints it as one line (exit 2), as it does for every other fixable input."""


def import_torchao(feature: str, module: str = "torchao") -> ModuleType:
    """Import ``module`` (``torchao`` or a submodule) for ``feature`` ("precision='fp8'", ...), or raise
    :class:`MissingExtraError` naming the pip command. Takes ~1 s the first time (torchao is large)."""
    try:
        root = importlib.import_module("torchao")
    except ImportError:
        raise MissingExtraError(f"{feature} needs torchao>=0.18, which is not installed: {LEAN_INSTALL}") from None
    version = getattr(root, "__version__", "0")
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if numbers < MIN_VERSION:
        # older torchao kept the optimizers under torchao.prototype and had another float8 config
        raise MissingExtraError(f"{feature} needs torchao>=0.18, found {version}: {LEAN_INSTALL} --upgrade")
    return importlib.import_module(module)


def require_torchao_for_precision(name: str) -> None:
    """The check a precision strategy makes at construction: the same message, as the
    :class:`~mixprec.precision.base.PrecisionNotSupportedError` callers of the registry expect."""
    try:
        import_torchao(f"precision={name!r}")
    except MissingExtraError as err:
        raise PrecisionNotSupportedError(str(err)) from None
