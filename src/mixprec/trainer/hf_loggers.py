"""The loggers a script written for HF's Trainer reads the Trainer's messages from.

Such a script, or its tests, finds the Trainer's messages on transformers' loggers: it sets their level
(``transformers.utils.logging.set_verbosity_info()``), captures ``transformers``' output, or patches
``transformers.trainer.logger.warning``. So where transformers is installed, the messages mixprec's Trainer
gives in HF's place go through the loggers of the same names, and ``log_level`` sets transformers' level as
HF's Trainer does. transformers' loggers are plain ``logging`` loggers (its ``get_logger(name)`` is
``logging.getLogger(name)``), so this imports nothing; without transformers, mixprec's own logger is used.
"""

from __future__ import annotations

import importlib.util
import logging
from functools import cache


@cache
def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None  # looks for it, does not import it


def hf_logger(module: str) -> logging.Logger:
    """The logger for a message HF gives from ``transformers.<module>`` ("trainer", "trainer_callback")."""
    return logging.getLogger(f"transformers.{module}" if transformers_installed() else "mixprec.trainer")


def set_library_log_level(level: str) -> None:
    """HF's ``log_level``: mixprec's logger level and, where installed, transformers' ("passive": left as is)."""
    if level == "passive":
        return
    logging.getLogger("mixprec").setLevel(level.upper())
    if transformers_installed():  # what HF's Trainer does with transformers.utils.logging.set_verbosity
        logging.getLogger("transformers").setLevel(level.upper())
