"""What the launcher told this process through the environment.

- torchrun (and ``accelerate launch``) set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT:
  :class:`LaunchEnv`, read once, and :func:`select_device`, this process's device from it.
- ``accelerate launch`` also hands its processes settings (``ACCELERATE_MIXED_PRECISION``...): a script moved
  from HF Accelerate by changing its import keeps being started with ``accelerate launch --mixed_precision
  fp16 ...``; HF's Accelerator reads these variables when an argument is left at its default, so mixprec's
  does too, or the launcher's fp16 would silently train in fp32. An argument given in the code always wins,
  as in accelerate.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mixprec.precision.base import default_device

_REQUIRED = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process (all defaults: a plain ``python script.py``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> LaunchEnv:
        world = int(environ.get("WORLD_SIZE", "1"))
        if "RANK" not in environ and torch.distributed.is_available() and torch.distributed.is_initialized():
            # The script joined a group itself without RANK (accelerate's debug_launcher: a file rendezvous
            # that sets only WORLD_SIZE): the group is the truth; one machine unless LOCAL_RANK says otherwise.
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            local = int(environ.get("LOCAL_RANK", str(rank)))
            return cls(rank, world, local, int(environ.get("LOCAL_WORLD_SIZE", str(world))))
        if world > 1:
            missing = [name for name in _REQUIRED if name not in environ]
            if missing:
                raise RuntimeError(
                    f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: launch with "
                    "`torchrun --nproc_per_node=N script.py`, which sets them all"
                )
        return cls(
            rank=int(environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world))),
        )


def select_device(device: torch.device | str | None, cpu: bool, env: LaunchEnv) -> torch.device:
    """The device this process trains on: ``cuda:LOCAL_RANK`` when CUDA is there, else the CPU."""
    if cpu:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"Accelerator(cpu=True, device={str(device)!r}): the two conflict; pass one of them")
        return torch.device("cpu")
    if device is None:  # the one default-device rule, and this process's GPU under a launcher
        dev = default_device()
        return torch.device("cuda", env.local_rank) if dev.type == "cuda" else dev
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"Accelerator(device={str(device)!r}): CUDA is not available on this machine; "
                "use device='cpu' (or cpu=True)"
            )
        if dev.index is None:
            dev = torch.device("cuda", env.local_rank)
    return dev


def launcher_mixed_precision(environ: Mapping[str, str] = os.environ) -> str:
    """The launcher's precision name ("no" when it set none); parsed later by the precision registry."""
    return environ.get("ACCELERATE_MIXED_PRECISION", "no") or "no"


def launcher_device(environ: Mapping[str, str] = os.environ) -> str | None:
    """The device the launcher assigned this process, if any."""
    return environ.get("ACCELERATE_TORCH_DEVICE") or None


def launcher_cpu(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the launcher asked for the CPU (``accelerate launch --cpu``)."""
    return environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes")


def launcher_accumulation(environ: Mapping[str, str] = os.environ) -> int:
    """The launcher's gradient accumulation steps (1 when it set none), for code that left the default of 1."""
    name = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
    raw = environ.get(name)
    if not raw:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: the launcher's gradient accumulation steps must be an integer") from None
