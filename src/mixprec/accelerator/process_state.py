"""``accelerator.state``: where this process runs and in what precision, as HF Accelerate's
``AcceleratorState`` exposes it to scripts (``accelerator.state.device``, ``.num_processes``...).

A read-only view over the Accelerator's distributed strategy and precision, not a process-wide singleton:
two Accelerators in one process each have their own (accelerate's shared state, and its ``_reset_state``,
are not reproduced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mixprec.accelerator.distributed import DistributedStrategy
    from mixprec.precision.base import Precision


class AcceleratorState:
    """The process's place in the run. Every attribute is read live, so ``mixed_precision`` follows
    precision="auto" once it has decided."""

    def __init__(self, strategy: DistributedStrategy, precision: Precision) -> None:
        self._strategy = strategy
        self._precision = precision

    @property
    def distributed_type(self) -> str:
        """ "single", "ddp" or "fsdp"."""
        return self._strategy.name

    @property
    def num_processes(self) -> int:
        return self._strategy.num_processes

    @property
    def process_index(self) -> int:
        return self._strategy.process_index

    @property
    def local_process_index(self) -> int:
        return self._strategy.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self._strategy.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._strategy.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def device(self) -> torch.device:
        return self._strategy.device

    @property
    def mixed_precision(self) -> str:
        return self._precision.name

    def __repr__(self) -> str:
        return (
            f"AcceleratorState(distributed_type={self.distributed_type!r}, num_processes={self.num_processes}, "
            f"process_index={self.process_index}, device={str(self.device)!r}, "
            f"mixed_precision={self.mixed_precision!r})"
        )
