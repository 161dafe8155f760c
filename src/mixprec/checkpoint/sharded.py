"""Sharded model checkpoints (torch.distributed.checkpoint): each process writes its own shard.

``Accelerator.save_state`` gathers an FSDP2 model onto the main process and writes one safetensors file:
simple, but the whole model passes through one process's memory. :func:`save_sharded` instead has every
process write only the parameters it holds (DCP's ``.distcp`` files plus its ``.metadata``), and
:func:`load_sharded` reads them back into a model sharded over any number of processes (DCP reshards: saved
by 2 processes, loaded by 1 or 4). :func:`export_safetensors` turns such a folder into one safetensors file
for inference (one process, no process group needed; also ``python -m mixprec.checkpoint.sharded``), as it does
the model of a ``save_state`` or Trainer checkpoint saved with ``fsdp_state_dict_type="sharded"``.

Atomic as the other checkpoints: every process writes into ``.<name>.tmp-<main pid>-<token>``; after a
barrier the main process writes ``manifest.json`` (every shard's size and SHA-256) last, then renames the
folder into place (:mod:`mixprec.checkpoint.atomic`). A kill at any moment leaves the previous folder or the
complete new one. Model weights only: optimizer state still goes through ``save_state``.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from mixprec.checkpoint.atomic import begin, recover, temp_path
from mixprec.checkpoint.folder_checks import MODEL_DIR
from mixprec.checkpoint.manifest import MANIFEST, seal, verify_manifest
from mixprec.checkpoint.safe_files import CheckpointError, save_tensors

_IN_CHECKPOINT = re.compile(MODEL_DIR.format(r"\d+").replace(".", r"\."))  # a save_state checkpoint's model_<i>.dcp


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _tag() -> str:
    """``<main pid>-<token>``, the same on every process (one tiny broadcast)."""
    mine = torch.tensor([os.getpid(), secrets.randbits(31)], dtype=torch.int64)
    if _distributed():
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        dist.broadcast(mine, src=0)
    pid, token = (int(x) for x in mine.tolist())
    return f"{pid}-{token:08x}"


def save_sharded(model: torch.nn.Module, folder: str | os.PathLike[str]) -> Path:
    """Write ``model``'s weights, each process its shard, into ``folder`` atomically. Collective."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    target = Path(folder)
    main = not _distributed() or dist.get_rank() == 0
    tag = _tag()
    tmp = begin(target, tag=tag) if main else temp_path(target, tag)
    if _distributed():
        dist.barrier()  # the folder exists for everyone
    save(get_model_state_dict(model), checkpoint_id=str(tmp))  # collective: .metadata written by rank 0 last
    if _distributed():
        dist.barrier()  # every shard is on disk
    if main:
        seal(tmp, target)  # the manifest, over every process's shard
    if _distributed():
        dist.barrier()
    return target


def check_sharded(folder: str | os.PathLike[str]) -> None:
    """Raise CheckpointError unless ``folder`` is a complete sharded checkpoint (its manifest verifies)."""
    path = Path(folder)
    recover(path)
    problem = verify_manifest(path) if path.is_dir() else "no such folder"
    if problem is None and not (path / ".metadata").is_file():
        problem = ".metadata is missing (not a torch.distributed.checkpoint folder)"
    if problem is not None:
        raise CheckpointError(f"{path}: not a complete sharded checkpoint ({problem})")


def load_sharded(model: torch.nn.Module, folder: str | os.PathLike[str]) -> None:
    """Load a :func:`save_sharded` folder into ``model``, however many processes saved it and however many
    load it (each reads the pieces its shard needs). Collective when a process group is running."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    check_sharded(folder)
    state = get_model_state_dict(model)
    load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state)


def sharded_model(folder: str | os.PathLike[str]) -> Path:
    """The complete DCP folder of model weights that ``folder`` names: a :func:`save_sharded` folder, or a
    ``save_state`` / Trainer checkpoint written with ``fsdp_state_dict_type="sharded"`` (its ``model_0.dcp``,
    whose shards the checkpoint's manifest lists), or one ``model_<i>.dcp`` inside such a checkpoint (one of
    several models). Raises CheckpointError, naming the problem, for anything else or anything damaged."""
    path = Path(folder)
    if path.is_dir() and not (path / ".metadata").exists():  # a checkpoint holding its models' DCP folders
        recover(path)
        models = sorted(path.glob(MODEL_DIR.format("*")))
        if len(models) > 1:
            raise CheckpointError(
                f"{path}: the checkpoint holds {len(models)} models' sharded weights; export one of them by naming "
                f"its folder, e.g. {models[0]}"
            )
        path = models[0] if models else path
    if not _IN_CHECKPOINT.fullmatch(path.name) or not (path.parent / MANIFEST).is_file():
        check_sharded(path)
        return path
    problem = verify_manifest(path.parent)  # the checkpoint's manifest covers every process's shards
    if problem is None and not (path / ".metadata").is_file():
        problem = f"{path.name}/.metadata is missing"
    if problem is not None:
        raise CheckpointError(f"{path.parent}: not a complete checkpoint ({problem})")
    return path


def export_safetensors(folder: str | os.PathLike[str], output: str | os.PathLike[str]) -> Path:
    """One safetensors file with the full (unsharded) weights of a :func:`save_sharded` folder, or of a
    checkpoint saved with ``fsdp_state_dict_type="sharded"`` (:func:`sharded_model`), for inference. One
    process; no process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp = sharded_model(folder)
    with tempfile.TemporaryDirectory(dir=Path(output).parent) as tmp:
        plain = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(dcp), str(plain))
        weights = torch.load(plain, map_location="cpu", weights_only=True)
    return save_tensors({k: v.contiguous() for k, v in weights.items()}, output)


if __name__ == "__main__":  # python -m mixprec.checkpoint.sharded FOLDER OUTPUT.safetensors
    if len(sys.argv) != 3:
        sys.exit("usage: python -m mixprec.checkpoint.sharded SHARDED_FOLDER OUTPUT.safetensors")
    print(export_safetensors(sys.argv[1], sys.argv[2]))
