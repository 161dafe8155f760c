"""HF ``TrainingArguments``' process helpers that example scripts call before any Trainer exists.

run_clm.py and its siblings read ``training_args.get_process_log_level()``, ``training_args.parallel_mode.value``
and wrap their dataset preprocessing in ``with training_args.main_process_first(desc=...)`` (issue 22). These
are the same calls on mixprec's TrainingArguments, answered from torchrun's environment as its other derived
properties (``world_size``, ``process_index``...) are.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from typing import Any

LEVELS = {
    "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
    "critical": logging.CRITICAL,
}  # fmt: skip


class ParallelMode(enum.Enum):
    """HF's ``ParallelMode`` values for what mixprec runs: one process, or several under torchrun."""

    NOT_PARALLEL = "not_parallel"
    DISTRIBUTED = "distributed"


class ProcessHelpers:
    """Mixed into :class:`~mixprec.trainer.args.TrainingArguments`; reads its ``log_level``, ``log_level_replica``,
    ``use_cpu``, ``world_size``, ``should_log`` and ``schedule``."""

    log_level: str
    log_level_replica: str
    use_cpu: bool
    world_size: int
    should_log: bool
    schedule: Any

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

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup in optimizer steps for a run of ``num_training_steps`` (``warmup_steps``, or the ratio)."""
        return self.schedule.num_warmup_steps(num_training_steps)

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """The main process (of each machine, with ``local``) runs the block first, then the others: dataset
        preprocessing written once to the cache and read by the rest. Joins torchrun's process group, as
        HF's does, when several processes run; the Trainer made afterwards uses the same group."""
        if self.world_size == 1:
            yield
            return
        from mixprec.strategies.process_state import PartialState

        state = PartialState(cpu=self.use_cpu)
        first = state.local_main_process_first() if local else state.main_process_first()
        with first:
            yield

    def to_sanitized_dict(self) -> dict[str, Any]:
        """The arguments for TensorBoard's hparams, as HF: numbers, strings and bools kept, the rest as str."""
        values = self.to_dict()  # type: ignore[attr-defined]
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
