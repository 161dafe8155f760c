"""A base for objects that stand in for an optimizer: ``param_groups``, ``state`` and ``defaults`` are the
wrapped optimizer's own (read and assigned through), so LR schedulers, the loss scaler and ``isinstance(x,
torch.optim.Optimizer)`` take the stand-in. Subclasses set ``self.__dict__["optimizer"]`` first and never run
``Optimizer.__init__`` (the stand-in holds no parameters of its own)."""

from __future__ import annotations

from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """Delegates the optimizer's three data attributes to ``self.optimizer``."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value
