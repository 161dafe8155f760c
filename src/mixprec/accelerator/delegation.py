"""How a facade names what its parts do, one line a member (as Lightning Fabric's facade hands each call to its
strategy or precision): ``gather = delegate("_processes", Processes.gather)`` in the class body says that
``accelerator.gather(...)`` is ``accelerator._processes.gather(...)``.

The member keeps the part's name, signature and docstring (``functools.wraps``), so ``help()``, ``inspect``
and the API reference read it as the facade's own; a property stays a property (settable when the part's is).
The part is an object the facade owns, with its own state: nothing here reaches back into the facade.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def delegate(part: str, member: Callable[..., Any] | property) -> Any:
    """A class-body member that forwards to the attribute ``part`` of the instance: the method ``member``
    called on that part (one extra Python call, no host sync), or the property ``member`` read (and set)
    on it."""
    if isinstance(member, property):
        name = member.fget.__name__ if member.fget is not None else ""

        def read(self: Any) -> Any:
            return getattr(getattr(self, part), name)

        def write(self: Any, value: Any) -> None:
            setattr(getattr(self, part), name, value)

        return property(read, write if member.fset is not None else None, doc=member.__doc__)

    @functools.wraps(member)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return member(getattr(self, part), *args, **kwargs)

    return forward
