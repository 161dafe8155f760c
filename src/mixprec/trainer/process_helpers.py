"""HF ``TrainingArguments``' process helpers and derived properties, answered before any Trainer exists.

run_clm.py and its siblings read ``training_args.get_process_log_level()``, ``training_args.parallel_mode.value``
and wrap their dataset preprocessing in ``with training_args.main_process_first(desc=...)`` (issue 22). These
are the same calls on mixprec's TrainingArguments, answered from torchrun's environment as its other derived
properties (``world_size``, ``process_index``...) are.

:class:`ProcessHelpers` is a part of :class:`~mixprec.trainer.args.TrainingArguments`, which delegates those
names to it: a frozen copy of the few fields it reads, built on access (as the grouped views of
:mod:`mixprec.trainer.configs`), so a field edited after construction is seen.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from mixprec.strategies.launch_env import LaunchEnv, select_device
from mixprec.strategies.process_state import PartialState

LEVELS = {name: getattr(logging, name.upper()) for name in ("debug", "info", "warning", "error", "critical")}


class ParallelMode(enum.Enum):
    """HF's ``ParallelMode`` values for what mixprec runs: one process, or several under torchrun."""

    NOT_PARALLEL = "not_parallel"
    DISTRIBUTED = "distributed"


@dataclass(frozen=True)
class ProcessHelpers:
    """HF's process helpers and derived properties (``device``, ``world_size``...) of a TrainingArguments,
    from its ``log_level``, ``log_level_replica``, ``use_cpu`` and batch sizes."""

    log_level: str
    log_level_replica: str
    use_cpu: bool
    per_device_train_batch_size: int
    per_device_eval_batch_size: int

    @classmethod
    def of(cls, args: Any) -> ProcessHelpers:
        """The helpers of ``args`` (a TrainingArguments), from its fields as they are now."""
        return cls(*(getattr(args, f.name) for f in fields(cls)))

    @property
    def device(self) -> torch.device:
        """The device this process trains on (the Accelerator's rule: ``cuda:LOCAL_RANK``, else the CPU)."""
        return select_device(None, self.use_cpu, LaunchEnv.from_environ())

    @property
    def n_gpu(self) -> int:
        """GPUs used by this process: 1 on a GPU, 0 on the CPU (mixprec never uses DataParallel, so never
        more, as HF under torchrun)."""
        return 1 if self.device.type == "cuda" else 0

    @property
    def train_batch_size(self) -> int:
        """The per-process training batch (HF: per_device_train_batch_size * max(1, n_gpu))."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def world_size(self) -> int:
        """Processes training together (torchrun's WORLD_SIZE; 1 for a plain ``python script.py``)."""
        return LaunchEnv.from_environ().world_size

    @property
    def process_index(self) -> int:
        return LaunchEnv.from_environ().rank

    @property
    def local_process_index(self) -> int:
        return LaunchEnv.from_environ().local_rank

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process only."""
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes files: the main process only."""
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """This process's logging level, as HF: ``log_level`` on the main process, ``log_level_replica`` on the
        others; "passive" is the level the "mixprec" logger already has."""
        name = self.log_level if self.should_log else self.log_level_replica
        return LEVELS.get(name) or logging.getLogger("mixprec").getEffectiveLevel()

    @property
    def parallel_mode(self) -> ParallelMode:
        """``DISTRIBUTED`` when torchrun started several processes, else ``NOT_PARALLEL``."""
        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def place_model_on_device(self) -> bool:
        """Whether the Trainer moves the model to the device itself: always (FSDP2 shards it in place after)."""
        return True

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """The main process (of each machine, with ``local``) runs the block first, then the others: dataset
        preprocessing written once to the cache and read by the rest. Joins torchrun's process group, as
        HF's does, when several processes run; the Trainer made afterwards uses the same group."""
        if self.world_size == 1:
            yield
            return
        state = PartialState(cpu=self.use_cpu)
        first = state.local_main_process_first() if local else state.main_process_first()
        with first:
            yield
