"""The Accelerator's settings, validated at construction with messages that name the field."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mixprec.accelerator.step_in_backward import REFUSALS
from mixprec.precision.announcement import RunContext
from mixprec.precision.registry import policy_name
from mixprec.strategies import launch_env
from mixprec.strategies.comm import make_comm
from mixprec.strategies.peers import timeout_delta
from mixprec.strategies.registry import KINDS

if TYPE_CHECKING:
    from mixprec.strategies.strategy import DistributedStrategy


@dataclass
class AcceleratorConfig:
    """Keyword arguments of :class:`~mixprec.accelerator.accelerator.Accelerator` (HF Accelerate's names
    where they overlap)."""

    mixed_precision: str | None = None
    """Precision name, parsed by the precision registry: "no"/"fp32", "fp16", "bf16", "auto" (or an alias);
    for a strategy already made (``Accelerator(mixed_precision=make_precision("bf16"))``), its name. None: what
    ``accelerate launch --mixed_precision`` set (``ACCELERATE_MIXED_PRECISION``), else "no"."""

    gradient_accumulation_steps: int = 1
    """Micro-batches summed per optimizer step (inside ``accumulate``); ``backward`` divides the loss by it."""

    distributed: str | None = None
    """None: DDP when launched with several processes, else one process. "ddp" or "fsdp" (FSDP2) to choose."""

    device: torch.device | str | None = None
    """Device to train on; default the one ``accelerate launch`` assigned (``ACCELERATE_TORCH_DEVICE``), else
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""

    cpu: bool = False
    """Train on the CPU even when CUDA is available (also set by ``accelerate launch --cpu``)."""

    scaler_kwargs: Mapping[str, Any] | None = None
    """Keyword arguments for the fp16 loss scaler (``mixprec.GradScaler``: init_scale, growth_interval...)."""

    ddp_kwargs: Mapping[str, Any] | None = None
    """Keyword arguments for ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``)."""

    fsdp_shard: Callable[[torch.nn.Module], bool] | None = None
    """FSDP2: which submodules are sharded as units of their own (default: members of every ModuleList)."""

    non_blocking: bool = False
    """Copy batches to the device asynchronously (useful with ``pin_memory=True`` DataLoaders)."""

    verbose: bool = True
    """Print the one-line summary of the resolved precision and processes at start (main process)."""

    timeout: float | None = None
    """Seconds a collective waits for every process before failing with an error naming the rank that did
    not answer (None: 300; see :mod:`mixprec.strategies.peers` for why). Applies when mixprec creates the
    process group."""

    fsdp_state_dict_type: str = "full"
    """FSDP2 checkpoints: "full" (gathered on the main process) or "sharded" (each process writes its own
    shards; :mod:`mixprec.strategies.dcp_state`). HF's FULL_STATE_DICT / SHARDED_STATE_DICT are accepted."""

    step_in_backward: bool = False
    """Update each parameter during backward, as soon as its gradient is ready, and free that gradient
    (:mod:`mixprec.accelerator.step_in_backward`): no step holds the model's gradients. Not with clipping,
    accumulation, fp16 or several processes (each refused by name)."""

    comm_dtype: Any = None
    """Dtype gradients travel in between processes: None/"fp32" (DDP's and FSDP2's default), "bf16" (half the
    bytes), "fp16"; or a :class:`~mixprec.strategies.comm.CommPrecision` (:mod:`mixprec.strategies.comm`)."""

    fp32_ops: Sequence[str] | str | None = None
    """Op kinds kept in fp32 under a bf16/fp16 ``mixed_precision`` (mixprec.precision.op_policy.OP_KINDS:
    linear, attention, norm, softmax, embedding, activation), e.g. ["attention"]; folded into the name
    ("bf16:fp32_ops=attention")."""

    step_scheduler_with_optimizer: bool = True
    """accelerate's: a prepared scheduler advances only when its optimizer really stepped (not while accumulating,
    not after a skipped fp16 step), ``num_processes`` times (see ``split_batches``). False: the script steps it
    when it chooses (each epoch, on a metric) and every ``scheduler.step()`` advances it once."""

    split_batches: bool = False
    """accelerate's: the DataLoader's batch is the global batch, split over the processes, so a prepared scheduler
    advances once per optimizer step. mixprec's DataLoaders do not split batches: accepted with one process
    (where splitting changes nothing), refused with several."""

    scheduler_counts_optimizer_steps: bool = False
    """mixprec's: the schedule's length is in optimizer steps (sized after ``prepare``, as mixprec's Trainer
    does), so a prepared scheduler advances once per optimizer step whatever the number of processes."""

    def __post_init__(self) -> None:
        # Arguments left at their defaults take what `accelerate launch` set, as HF's Accelerator does.
        if self.mixed_precision is None:
            self.mixed_precision = launch_env.launcher_mixed_precision()
        if self.fp32_ops:
            self.mixed_precision = named_argument(
                lambda: policy_name(self.mixed_precision, self.fp32_ops), self.fp32_ops, "fp32_ops"
            )
        if self.device is None and not self.cpu:
            self.device = launch_env.launcher_device()
        self.cpu = self.cpu or launch_env.launcher_cpu()
        if self.gradient_accumulation_steps == 1:
            self.gradient_accumulation_steps = launch_env.launcher_accumulation()
        steps = self.gradient_accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"Accelerator(gradient_accumulation_steps={steps!r}): gradient_accumulation_steps must be an "
                "integer >= 1"
            )
        if self.step_in_backward and steps != 1:
            raise ValueError(
                f"Accelerator(gradient_accumulation_steps={steps}, step_in_backward=True): {REFUSALS['accumulate']}"
            )
        if self.distributed is not None and self.distributed not in KINDS:
            raise ValueError(
                f"Accelerator(distributed={self.distributed!r}): distributed must be None, "
                + " or ".join(repr(k) for k in KINDS)
            )
        for name in ("scaler_kwargs", "ddp_kwargs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"Accelerator({name}=...): {name} must be a dict, got {type(value).__name__}")
        timeout_delta(self.timeout)  # raises naming the argument
        if self.fsdp_shard is not None and not callable(self.fsdp_shard):
            raise TypeError("Accelerator(fsdp_shard=...): fsdp_shard must be a callable (module) -> bool")
        if self.fsdp_shard is not None and self.distributed != "fsdp":
            raise ValueError("Accelerator(fsdp_shard=...): fsdp_shard applies only with distributed='fsdp'")
        self.comm_dtype = make_comm(self.comm_dtype)  # parsed once, here; raises naming comm_dtype
        self.fsdp_state_dict_type = parse_state_dict_type(self.fsdp_state_dict_type, self.distributed, "Accelerator")


STATE_DICT_TYPES = {"full": "full", "sharded": "sharded", "full_state_dict": "full", "sharded_state_dict": "sharded"}


def parse_state_dict_type(value: object, distributed: str | None, where: str) -> str:
    """ "full" or "sharded" from either spelling (HF's ``SHARDED_STATE_DICT`` too), "sharded" only with
    ``distributed="fsdp"``; errors name ``where``."""
    found = STATE_DICT_TYPES.get(value.lower()) if isinstance(value, str) else None
    if found is None:
        raise ValueError(
            f"{where}(fsdp_state_dict_type={value!r}): choose 'full' (gathered on the main process) or 'sharded' "
            "(each process writes its shards)"
        )
    if found == "sharded" and distributed != "fsdp":
        raise ValueError(f"{where}(fsdp_state_dict_type='sharded'): sharded checkpoints need distributed='fsdp'")
    return found


def scheduler_rule(config: AcceleratorConfig, num_processes: int) -> dict[str, Any]:
    """How a prepared scheduler advances (``PreparedScheduler``'s keywords): with its optimizer or not, and how
    many times per optimizer step: ``num_processes`` (accelerate's rule: a script sizes its schedule from its
    DataLoader's length before ``prepare``, and each process then sees 1/N of those batches), or 1 with
    ``split_batches`` or ``scheduler_counts_optimizer_steps``."""
    if config.split_batches and num_processes > 1:
        raise ValueError(
            f"Accelerator(split_batches=True) with {num_processes} processes: mixprec's DataLoaders do not split "
            "batches; give the DataLoader the per-process batch size (global batch / processes) and drop "
            "split_batches"
        )
    one = config.split_batches or config.scheduler_counts_optimizer_steps
    return {"with_optimizer": config.step_scheduler_with_optimizer, "per_step": 1 if one else num_processes}


def named_argument(parse: Callable[[], Any], value: Any, argument: str = "mixed_precision") -> Any:
    """The precision registry's answer, with the Accelerator's argument named in its message."""
    try:
        return parse()
    except ValueError as err:  # PrecisionNotSupportedError too: keep its type
        raise type(err)(f"Accelerator({argument}={value!r}): {err}") from None


def run_context(config: AcceleratorConfig, strategy: DistributedStrategy) -> RunContext:
    """What this run is around its precision, for the line the precision says (precision/announcement.py)."""
    in_backward = "; optimizer steps in backward (each gradient freed once applied)"
    return RunContext(
        processes=strategy.describe(),
        comm=config.comm_dtype.describe(strategy.num_processes),
        extra=in_backward if config.step_in_backward else "",
        is_main=strategy.is_main_process,
        verbose=config.verbose,
    )
