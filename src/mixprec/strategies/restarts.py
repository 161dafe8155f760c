"""Whether torchelastic restarted the worker group: the signal that a run resumes by itself.

``torchrun --max-restarts=N`` restarts every worker after one fails, and tells the workers through
``TORCHELASTIC_RESTART_COUNT``. That count is kept per node: on several nodes, the node whose worker failed
counts the restart, while a node whose workers were restarted only to re-join the rendezvous may still say 0
(which of the two a healthy node's agent sees first is a race). So the decision to resume is taken
collectively: if any process of the new group was restarted, all of them resume.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch


def restarted_by_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchelastic restarted *this node's* workers after a failure (see the module's note)."""
    try:
        return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    except ValueError:
        return False


def restarts_allowed_on_several_nodes(environ: Mapping[str, str] = os.environ) -> bool:
    """A multi-node torchelastic job that may restart: a node's worker may be in a restarted group without
    knowing it (its own count still 0)."""
    try:
        nodes = int(environ.get("GROUP_WORLD_SIZE", "1"))
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    return nodes > 1 and restarts > 0


def restarted_anywhere(accelerator: Any) -> bool:
    """Whether the launcher restarted any process of this worker group (one tiny all-reduce). Collective."""
    restarted = restarted_by_launcher()
    if accelerator.num_processes <= 1:
        return restarted
    flag = accelerator.reduce(torch.tensor(int(restarted)), "max")
    return bool(int(flag.item()))


def agree_on_number(accelerator: Any, number: int) -> int:
    """The main process's ``number`` (an int >= -2), on every process (one tiny all-reduce). Collective."""
    if accelerator.num_processes <= 1:
        return number
    shifted = number + 3 if accelerator.is_main_process else 0
    return int(accelerator.reduce(torch.tensor(shifted), "sum").item()) - 3
