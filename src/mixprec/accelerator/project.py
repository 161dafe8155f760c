"""HF Accelerate's ``ProjectConfiguration``: the project folder, and whether ``save_state()`` with no path
names its checkpoints itself (``{project_dir}/checkpoints/checkpoint_{iteration}``) and how many it keeps. The
settings only: the Accelerator's checkpoint manager (:mod:`mixprec.checkpoint.manager`) reads them at each
save and load, and owns the numbering, the listing and the pruning (and how they differ from accelerate's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class ProjectConfiguration:
    """``Accelerator(project_config=...)``: HF Accelerate's fields and meaning."""

    # str | None (a PathLike works too): what HfArgumentParser can parse, as accelerate's annotation.
    project_dir: str | None = None
    """Folder for the run's files; automatic checkpoints go to its ``checkpoints/`` subfolder."""

    logging_dir: str | None = None
    """Folder for local loggers' files (default: ``project_dir``)."""

    automatic_checkpoint_naming: bool = False
    """``save_state()`` / ``load_state()`` with no path write / read ``checkpoints/checkpoint_{iteration}``."""

    total_limit: int | None = None
    """Keep at most this many automatic checkpoints (the oldest are deleted); None keeps all."""

    iteration: int = 0
    """The number the next automatic checkpoint gets; incremented by every ``save_state``."""

    save_on_each_node: bool = False
    """Accepted for accelerate's scripts; mixprec assumes one filesystem shared by the processes that save."""

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)
        limit = self.total_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"ProjectConfiguration(total_limit={limit!r}): total_limit must be None or an int >= 1")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise ValueError(f"ProjectConfiguration(iteration={self.iteration!r}): iteration must be an int >= 0")

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when not given (as accelerate)."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir
