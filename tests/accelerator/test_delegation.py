"""accelerator/delegation.py: a facade names each public member in its own class body and the part that does
it (issue 35: composition over mixins), and a delegated member reads as the part's own (name, signature,
docstring; a settable property stays settable)."""

from __future__ import annotations

import inspect

import pytest

from mixprec import Accelerator, Trainer
from mixprec.accelerator.delegation import delegate


@pytest.mark.parametrize("facade", [Accelerator, Trainer])
def test_a_facade_names_every_public_member_in_its_own_body(facade: type) -> None:
    assert facade.__mro__ == (facade, object)  # no mixin base classes sharing its private state
    public = {name for name in dir(facade) if not name.startswith("_")}
    assert public <= set(vars(facade)), sorted(public - set(vars(facade)))


class _Part:
    def __init__(self) -> None:
        self._level = 1

    def scaled(self, value: float, *, factor: float = 2.0) -> float:
        """``value`` times ``factor``."""
        return value * factor * self._level

    @property
    def level(self) -> int:
        """The part's level."""
        return self._level

    @level.setter
    def level(self, level: int) -> None:
        self._level = level

    @property
    def fixed(self) -> int:
        """Read only."""
        return 7


class _Facade:
    def __init__(self) -> None:
        self._part = _Part()

    scaled = delegate("_part", _Part.scaled)
    level = delegate("_part", _Part.level)
    fixed = delegate("_part", _Part.fixed)


def test_a_delegated_member_reads_as_the_parts_own() -> None:
    facade = _Facade()
    assert facade.scaled(3.0, factor=4.0) == 12.0
    assert _Facade.scaled.__name__ == "scaled" and _Facade.scaled.__doc__ == "``value`` times ``factor``."
    assert str(inspect.signature(facade.scaled)) == "(value: 'float', *, factor: 'float' = 2.0) -> 'float'"
    facade.level = 3  # the part's setter: the state is the part's
    assert facade._part.level == 3 and facade.level == 3 and facade.scaled(1.0) == 6.0
    assert _Facade.level.__doc__ == "The part's level."
    with pytest.raises(AttributeError):
        facade.fixed = 8  # the part's property has no setter, nor has the facade's


def test_the_accelerator_keeps_accelerates_signatures_through_its_parts() -> None:
    params = inspect.signature(Accelerator.save_state).parameters
    assert list(params) == ["self", "output_dir", "safe_serialization", "extra_json", "async_save"]
    assert "Collective" in (Accelerator.gather.__doc__ or "")
    acc = Accelerator(cpu=True, verbose=False)
    assert acc.num_processes == 1 and acc.is_main_process and acc.watch is None
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()  # raised once, lowered by the check
