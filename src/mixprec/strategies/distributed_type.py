"""``accelerator.distributed_type``: the kind of run in accelerate's vocabulary (issue 22).

Scripts and accelerate's own helpers compare it with accelerate's ``DistributedType`` (``LocalSGD`` refuses any
value outside ``[NO, MULTI_CPU, MULTI_GPU, ...]``). Both enums are ``str`` enums whose values are the member
names, so ``mixprec.DistributedType.MULTI_GPU == accelerate.DistributedType.MULTI_GPU`` (and ``== "MULTI_GPU"``)
holds without importing accelerate. Each strategy answers for itself (``DistributedStrategy.distributed_type``);
mixprec's own name for the kind stays ``strategy.name`` ("single", "ddp", "fsdp").
"""

from __future__ import annotations

import enum

import torch


class DistributedType(str, enum.Enum):
    """The kinds mixprec runs, with accelerate's names and values."""

    NO = "NO"
    """One process."""
    MULTI_CPU = "MULTI_CPU"
    """DDP over processes on CPUs."""
    MULTI_GPU = "MULTI_GPU"
    """DDP over processes on CUDA devices."""
    MULTI_XPU = "MULTI_XPU"
    """DDP over processes on Intel XPUs."""
    FSDP = "FSDP"
    """FSDP2 (``torch.distributed.fsdp.fully_shard``), on any device."""

    @classmethod
    def data_parallel(cls, device: torch.device) -> DistributedType:
        """DDP's kind on ``device``, as accelerate names it: by the device type, the CPU's when it has none."""
        # accelerate names DDP by the device, not by the wrapper; a device type it has no MULTI_ name for here
        # (mps, which DDP cannot join anyway) reads as MULTI_CPU, which LocalSGD and friends accept alike.
        return {"cuda": cls.MULTI_GPU, "xpu": cls.MULTI_XPU}.get(device.type, cls.MULTI_CPU)
