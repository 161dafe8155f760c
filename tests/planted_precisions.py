"""Precision strategies made slow on purpose, for the tests of "auto": a mode's forward burns this thread's
CPU time (the race's clock on a CPU: a sleep would not show in it), far above any scheduling noise, so a
test says what auto does with a measurement, not what this machine measures."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import Bf16MixedPrecision


def burn(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its own CPU time (the race's clock on a CPU: a sleep would
    not show in it, as a neighbour's work does not)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Sleepy:
    """Mixin: this mode's forward burns 30 ms of CPU, so it is slow by far more than any noise."""

    def autocast(self) -> Any:
        @contextlib.contextmanager
        def slow() -> Any:
            with super(_Sleepy, self).autocast():
                burn(0.03)
                yield

        return slow()


class SleepyFp32(_Sleepy, FullPrecision):
    pass


class SleepyBf16(_Sleepy, Bf16MixedPrecision):
    pass


class SteadyBf16(Bf16MixedPrecision):
    """bf16 whose trial burns 10 ms: a third of SleepyFp32's, and steady enough to re-check from a cache."""

    def autocast(self) -> Any:
        @contextlib.contextmanager
        def steady() -> Any:
            with super(SteadyBf16, self).autocast():
                burn(0.01)
                yield

        return steady()


class SetUpBf16(Bf16MixedPrecision):
    """bf16 paying one-time setup, as on a GPU's first bf16 calls: each module's first two forwards under it
    burn 60 ms (twice SleepyFp32's whole trial); settled, it is much faster than SleepyFp32."""

    def __init__(self, device: Any) -> None:
        super().__init__(device)
        self.calls: dict[int, int] = {}

    def autocast(self) -> Any:
        @contextlib.contextmanager
        def setting_up() -> Any:
            def hook(module: torch.nn.Module, args: Any) -> None:
                self.calls[id(module)] = self.calls.get(id(module), 0) + 1
                if self.calls[id(module)] <= 2:
                    burn(0.06)

            handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
            try:
                with super(SetUpBf16, self).autocast():
                    yield
            finally:
                handle.remove()

        return setting_up()
