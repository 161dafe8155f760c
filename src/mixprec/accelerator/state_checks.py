"""What a ``save_state`` folder must satisfy before ``load_state`` changes anything (issue 14, fault 4).

- :func:`folder_problem` / :func:`check_folder`: the folder is complete and intact (its manifest verifies;
  a folder written before manifests is accepted, with a warning, when its metadata and RNG file are there);
- :func:`check_model_fits` / :func:`check_optimizer_fits`: the state fits the prepared objects, checked
  before loading because ``Module.load_state_dict`` copies the entries that match before it complains
  about the others, which would leave a half-loaded model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint import CheckpointError
from mixprec.checkpoint.manifest import NO_MANIFEST, verify_manifest

META = "accelerator.json"
logger = logging.getLogger("mixprec.accelerator")


def folder_problem(path: Path, *, process_index: int = 0) -> str | None:
    """None if ``path`` is a complete, intact ``save_state`` folder: its manifest verifies, or, for a folder
    written before manifests, its metadata and this process's RNG file are there (accepted with a warning
    that its files cannot be checked). Else what is wrong, in a phrase naming the file. Reads every file."""
    if not path.is_dir():
        return "no such folder"
    problem = verify_manifest(path)
    if problem == NO_MANIFEST:
        if not (path / META).is_file():
            return f"no {META} and no manifest.json there, so it is not a folder written by save_state"
        if not (path / f"rng_state_{process_index}.pt").is_file():
            return f"rng_state_{process_index}.pt is missing (and there is no manifest.json)"
        logger.warning("%s has no manifest.json (written by an older mixprec): its files cannot be checked", path)
        return None
    return problem


def check_folder(path: Path, *, process_index: int = 0) -> None:
    """Raise unless :func:`folder_problem` finds nothing: FileNotFoundError for a folder that is not a
    ``save_state`` folder at all, CheckpointError (naming the file and what is wrong) for a damaged one."""
    problem = folder_problem(path, process_index=process_index)
    if problem is None:
        return
    if problem == "no such folder" or problem.startswith(f"no {META}"):
        raise FileNotFoundError(f"load_state({str(path)!r}): {problem}")
    raise CheckpointError(f"{path}: {problem}; the folder is damaged or incomplete, nothing was loaded from it")


def check_model_fits(
    model: torch.nn.Module, state: dict[str, torch.Tensor], file: Path, required: set[str] | None = None
) -> None:
    """``load_state_dict`` copies what matches before it complains about the rest: check names and shapes
    first, so a mismatch changes nothing. ``required``: the entries the state must hold (default: all of the
    model's; a peft model's checkpoint holds its trainable ones, see :mod:`mixprec.accelerator.model_part`)."""
    mine = model.state_dict()
    missing = sorted((set(mine) if required is None else required) - set(state))
    unexpected = sorted(set(state) - set(mine))
    if missing or unexpected:
        what = f"lacks {missing[:3]}" if missing else f"has unknown entries {unexpected[:3]}"
        raise CheckpointError(f"{file} does not fit the prepared model: it {what}; prepare the same model as was saved")
    for name, tensor in mine.items():
        if name in state and tuple(tensor.shape) != tuple(state[name].shape):
            raise CheckpointError(
                f"{file} does not fit the prepared model: {name} is {tuple(state[name].shape)} there and "
                f"{tuple(tensor.shape)} here; prepare the same model as was saved"
            )


def check_optimizer_fits(optimizer: torch.optim.Optimizer, state: Any, file: Path) -> None:
    """What ``Optimizer.load_state_dict`` would refuse, checked before anything is loaded."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{file} is not an optimizer state (no param_groups/state)")
    sizes = [len(g.get("params", ())) for g in groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"{file} holds parameter groups of sizes {sizes}, the prepared optimizer "
            f"{[len(g['params']) for g in optimizer.param_groups]}; prepare the same optimizer as was saved"
        )
