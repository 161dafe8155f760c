"""torchao, the optional dependency behind the memory-lean modes (fp8 training, 8/4-bit optimizer states).

mixprec imports without it; the modes that need it import it here, on first use, so a missing or too old
torchao is one line that says what to install, wherever it is asked for (a precision name, an ``optim``
name, the command line).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from collections.abc import Iterator
from types import ModuleType

import torch

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
        with _quiet_import():
            root = importlib.import_module("torchao")
    except ImportError:
        raise MissingExtraError(f"{feature} needs torchao>=0.18, which is not installed: {LEAN_INSTALL}") from None
    version = getattr(root, "__version__", "0")
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if numbers < MIN_VERSION:
        # older torchao kept the optimizers under torchao.prototype and had another float8 config
        raise MissingExtraError(f"{feature} needs torchao>=0.18, found {version}: {LEAN_INSTALL} --upgrade")
    return importlib.import_module(module)


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Silence what torchao's import logs that is meant for its developers, not our users: a deprecation
    from torch's pytree about torchao's own enum registration and, on a machine without CUDA, a warning per
    CUDA kernel library it cannot load ("Failed to load .../_C_cutlass_90a.abi3.so": expected there, and
    alarming to read). Where CUDA exists, those load failures stay visible."""
    names = ["torch.utils._pytree"] + ([] if torch.cuda.is_available() else ["torchao"])
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def require_torchao_for_precision(name: str) -> None:
    """The check a precision strategy makes at construction: the same message, as the
    :class:`~mixprec.precision.base.PrecisionNotSupportedError` callers of the registry expect."""
    try:
        import_torchao(f"precision={name!r}")
    except MissingExtraError as err:
        raise PrecisionNotSupportedError(str(err)) from None
