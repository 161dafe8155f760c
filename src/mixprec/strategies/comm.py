"""Gradient communication precision: the dtype gradients travel in between processes.

Mixed precision saves memory and compute; this is its third gain, communication. By default DDP all-reduces
fp32 gradients whatever the precision, and FSDP2 reduce-scatters them in fp32. ``Accelerator(comm_dtype=
"bf16")`` sends them in bf16 instead (``"fp16"``: in fp16), half the bytes per step:

- DDP: torch's communication hooks (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``:
  ``bf16_compress_hook`` / ``fp16_compress_hook``). Each gradient bucket is cast to the wire dtype, divided by
  the process count, all-reduced, and copied back into the fp32 bucket; the optimizer still sees fp32
  gradients, averaged with one rounding to the wire dtype per process plus the rounding of the sum.
- FSDP2: ``MixedPrecisionPolicy(reduce_dtype=...)``: the reduce-scatter runs in the wire dtype.

Safe with loss scaling: an fp16 bucket whose scaled gradients exceed fp16's range (65504) becomes inf on the
wire, the inf is all-reduced to every process, and the loss scaler (or, in the unscaled modes, the non-finite
guard) finds it in the averaged gradients: the step is skipped on every process and fp16's scale backs off,
exactly as for an overflow in the backward itself. Never a silent inf (tests/strategies/test_comm.py plants one). bf16
has fp32's range, so it cannot overflow on the wire where fp32 would not. fp16 on the wire without loss
scaling (an fp32 or bf16 run) flushes gradients below 6e-8 to zero: prefer bf16 there.

Names are parsed here only (:func:`make_comm`); a :class:`CommPrecision` object is accepted as well.
PowerSGD (low-rank compression with error feedback) is not offered: its error-feedback memory holds
gradients in the loss scale of the step that made them, and one skipped (non-finite) step poisons it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {
    "no": "fp32",
    "none": "fp32",
    "32": "fp32",
    "float32": "fp32",
    "fp32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "16": "fp16",
}
COMM_NAMES = tuple(_DTYPES)


@dataclass(frozen=True)
class CommPrecision:
    """How gradients travel between processes: ``name`` ("fp32", "bf16", "fp16") and its ``wire_dtype``."""

    name: str = "fp32"

    @property
    def wire_dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def compresses(self) -> bool:
        """Whether gradients travel in fewer bits than fp32."""
        return self.wire_dtype != torch.float32

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Install this setting's communication hook on a freshly built DDP wrapper (DDP allows one hook per
        wrapper); none for fp32, which DDP all-reduces itself, in C++."""
        hook = _HOOKS.get(self.name)
        if hook is not None:
            ddp.register_comm_hook(state=None, hook=hook)  # state None: the default (world) process group

    def fsdp_reduce_dtype(self, compute_dtype: torch.dtype) -> torch.dtype | None:
        """FSDP2's ``MixedPrecisionPolicy.reduce_dtype``: the wire dtype; for fp32, fp32 when the parameters
        are gathered in a lower precision (else FSDP2 would reduce in that) and None (no policy) otherwise."""
        if self.compresses:
            return self.wire_dtype
        return torch.float32 if compute_dtype != torch.float32 else None

    def describe(self, processes: int) -> str:
        """How the run's gradients travel, for the run header and summary ("" for one process in fp32: nothing
        to say); a compressed setting in a single process is named as unused, never passed over in silence."""
        if processes > 1:
            return f"gradients travel in {self.name}"
        return f"comm_dtype {self.name} unused (one process: no gradients travel)" if self.compresses else ""


# torch's hooks, called through functions of other names: DDP refuses a hook *named* bf16_compress_hook unless
# CUDA with NCCL >= 2.10 is present, yet gloo all-reduces bf16 on CPU (torch 2.13; what the CPU tests run).
# Unannotated: DDP checks annotations against the real classes, and here (postponed) they would be strings.
def _bf16_wire(process_group, bucket):  # noqa: ANN001, ANN202
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(process_group, bucket)


def _fp16_wire(process_group, bucket):  # noqa: ANN001, ANN202
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return fp16_compress_hook(process_group, bucket)


_HOOKS = {"bf16": _bf16_wire, "fp16": _fp16_wire}


def make_comm(value: str | CommPrecision | None, where: str = "Accelerator(comm_dtype=...)") -> CommPrecision:
    """The one parser of communication-precision names: None (fp32, DDP's default), "fp32", "bf16", "fp16"
    (aliases "no", "bfloat16", "float16"...), or a :class:`CommPrecision`. ValueError names ``where``."""
    if isinstance(value, CommPrecision):
        return value
    if value is None:
        return CommPrecision("fp32")
    name = _ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    if name is None:
        if isinstance(value, str) and "power" in value.lower():
            raise ValueError(
                f"{where}: {value!r} is not offered (PowerSGD's error feedback is poisoned by one skipped step); "
                f"choose one of: {', '.join(COMM_NAMES)} ('bf16' halves the bytes)"
            )
        raise ValueError(f"{where}: unknown communication dtype {value!r}; choose one of: {', '.join(COMM_NAMES)}")
    return CommPrecision(name)
