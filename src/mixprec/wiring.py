"""Late bindings: what a lower layer calls but must not import, filled in by the package's face.

``Accelerator(watch=50)`` builds a precision watch (:mod:`mixprec.watch`, the layer above the Accelerator).
The face, ``mixprec/__init__.py``, sets :data:`build_watch` when the package is imported, which Python does
before any of its submodules, so the Accelerator calls it with no import arrow pointing up. torch-free, so
setting it keeps ``import mixprec`` light.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

build_watch: Callable[[Any, str], Any] | None = None
"""``build_watch(setting, where)``: the watch for ``Accelerator(watch=setting)`` (a watch object passes
through), or None when the setting turns it off; ``where`` names the argument in errors."""


def watch_for(setting: Any, where: str) -> Any:
    """The watch for ``setting`` (None: off) through :data:`build_watch`."""
    if setting is None:
        return None
    if build_watch is None:  # the face sets it on `import mixprec`, which precedes every submodule
        raise RuntimeError(f"{where}: mixprec.wiring.build_watch is not set; import mixprec first")
    return build_watch(setting, where)
