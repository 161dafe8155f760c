"""How a facade names what its parts do, one line a member (as Lightning Fabric's facade hands each call to its
strategy or precision): ``gather = delegate("_processes", Processes.gather)`` in the class body says that
``accelerator.gather(...)`` is ``accelerator._processes.gather(...)``.

The member keeps the part's name, signature and docstring (``functools.wraps``), so ``help()``, ``inspect``
and the API reference read it as the facade's own; a property stays a property (settable when the part's is).
The part is an object the facade owns, with its own state: nothing here reaches back into the facade.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any


def delegate(part: str, member: Callable[..., Any] | property) -> Any:
    """A class-body member that forwards to the attribute ``part`` of the instance: the method ``member``
    called on that part (one extra Python call, under a microsecond; no host sync), or the property ``member``
    read (and set) on it."""
    part_of = operator.attrgetter(part)  # C-level lookups: a delegated read costs about one extra getattr
    if isinstance(member, property):
        name = member.fget.__name__ if member.fget is not None else ""

        def write(self: Any, value: Any) -> None:
            setattr(part_of(self), name, value)

        read = operator.attrgetter(f"{part}.{name}")
        return property(read, write if member.fset is not None else None, doc=member.__doc__)

    @functools.wraps(member)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return member(part_of(self), *args, **kwargs)

    return forward
