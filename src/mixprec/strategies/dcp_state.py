"""Sharded model and optimizer state inside a ``save_state`` folder, through torch.distributed.checkpoint (DCP).

``Accelerator(distributed="fsdp", fsdp_state_dict_type="sharded")`` (``TrainingArguments(fsdp_state_dict_type=
"sharded")``): instead of gathering the full weights and optimizer state on the main process (a memory peak
and a wait for everyone else), every process writes its own shards into the unfinished folder, in one
``model_<i>.dcp/`` and one ``optimizer_<i>.dcp/`` subfolder per prepared object. The folder stays one atomic
unit: the main process seals it (SHA-256 manifest over every file, shards included) only after every process
reported its writes done, then renames it into place (:mod:`mixprec.checkpoint.folder_format`).

Loading reshards: DCP reads, for each process, the pieces of the saved shards its own shard covers, so a state
saved by N processes loads into M (FSDP2 with another process count, or a single process without FSDP, where
the shards become full tensors). Collective when a process group is running (call on every process).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mixprec.checkpoint.folder_checks import MODEL_DIR, OPTIMIZER_DIR  # the folder's layout has one home


def save_sharded_state(
    models: list[torch.nn.Module],
    optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]],
    folder: Path,
) -> None:
    """Write each model's and each (owner model, optimizer)'s sharded state under ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for i, model in enumerate(models):
        dcp.save(get_model_state_dict(model), checkpoint_id=str(folder / MODEL_DIR.format(i)))
    for i, (owner, optimizer) in enumerate(optimizers):
        state = get_optimizer_state_dict(owner, optimizer)
        dcp.save(state, checkpoint_id=str(folder / OPTIMIZER_DIR.format(i)))


def load_sharded_state(
    models: list[torch.nn.Module],
    optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]],
    folder: Path,
) -> None:
    """Read what :func:`save_sharded_state` wrote into the prepared ``models`` and ``optimizers``, resharding
    to this run's processes. DCP checks names and shapes object by object, so a mismatch found in a later
    object leaves the earlier ones loaded (see :mod:`mixprec.checkpoint.folder_format`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for i, model in enumerate(models):
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=str(folder / MODEL_DIR.format(i)))
        set_model_state_dict(model, state)
    for i, (owner, optimizer) in enumerate(optimizers):
        state = get_optimizer_state_dict(owner, optimizer)
        dcp.load(state, checkpoint_id=str(folder / OPTIMIZER_DIR.format(i)))
        set_optimizer_state_dict(owner, optimizer, state)
