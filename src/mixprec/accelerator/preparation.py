"""The Accelerator's preparation part: ``prepare`` and its kinds, what it accepts (and what it refuses about a
model, before touching it, with the fix in the message), the registry of what it prepared, and
``free_memory``, the other end of a prepared object's life.

:class:`Preparation` is a part the :class:`~mixprec.accelerator.accelerator.Accelerator` owns and delegates to
(``accelerator.prepare(...)`` is ``accelerator._prepared.prepare(...)``). It owns the registry that
``save_state`` / ``load_state`` read; it asks the distributed strategy to wrap, the precision strategy to
convert, and the accumulation schedule to count.
"""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from mixprec.accelerator.config import scheduler_rule
from mixprec.accelerator.prepared import (
    PreparedOptimizer,
    PreparedScheduler,
    is_prepared,
    patch_forward,
    prepared_with,
    unwrap,
)
from mixprec.accelerator.step_in_backward import BackwardStepper
from mixprec.loaders.data import PreparedDataLoader, prepare_dataloader, skip_first_batches
from mixprec.precision.policy import recomputes_activations

if TYPE_CHECKING:
    from mixprec.accelerator.config import AcceleratorConfig
    from mixprec.accelerator.gradients import GradientState
    from mixprec.checkpoint.folder_checks import Registry
    from mixprec.loaders.data_config import DataLoaderConfiguration
    from mixprec.precision.base import Precision
    from mixprec.strategies.strategy import DistributedStrategy

_ACCEPTED = (
    "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader and LR schedulers "
    "(torch.optim.lr_scheduler.LRScheduler)"
)


class Preparation:
    """``prepare`` and what it registered (see the module doc). ``watch``: the precision watch, attached to
    each model prepared, given ``host`` (the Accelerator: :class:`~mixprec.watch.host.WatchHost`)."""

    def __init__(
        self,
        registry: Registry,
        strategy: DistributedStrategy,
        precision: Precision,
        gradients: GradientState,
        config: AcceleratorConfig,
        loader_config: DataLoaderConfiguration,
        *,
        fence: Any,
        host: Any,
    ) -> None:
        self.registry = registry
        self._strategy = strategy
        self._precision = precision
        self._gradients = gradients
        self._step_in_backward = config.step_in_backward
        self._non_blocking = config.non_blocking
        self._dispatch_batches = loader_config.dispatch_batches
        self._scheduler_rule = scheduler_rule(config, strategy.num_processes)  # refuses split_batches here
        self._fence = fence  # an asynchronous save's copy of the weights: steps wait for it
        self._host = host
        self._watch: Any = None

    @property
    def watch(self) -> Any:
        """The precision watch (:mod:`mixprec.watch`; ``Accelerator(watch=...)``), or None when off: it
        attaches itself to each model ``prepare`` returns from then on, with this Accelerator as its host."""
        return self._watch

    @watch.setter
    def watch(self, watch: Any) -> None:
        self._watch = watch

    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers, in any order; returned in that order
        (a single object when one is passed; None passes through in its place). Models go first, so
        optimizers can follow their parameters."""
        kinds = [object_kind(obj, i) for i, obj in enumerate(objects)]
        result = list(objects)
        steps = (
            ("model", self.prepare_model),
            ("optimizer", self.prepare_optimizer),
            ("scheduler", self.prepare_scheduler),
            ("dataloader", self.prepare_data_loader),
        )
        for kind, prepare in steps:
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    result[i] = prepare(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The same module, on the device, its forward under autocast (and DDP/FSDP2 when distributed)."""
        if is_prepared(model):
            if self.prepared_here(model):
                return model
            if prepared_with(model) is self._precision:  # prepared here, then dropped by free_memory
                self.registry.models.append(model)
                return model
            raise ValueError(f"{type(model).__name__} was prepared by another Accelerator")
        check_preparable(model)
        if self._precision.recompute_refusal and recomputes_activations(model):  # said here, not at backward
            raise ValueError(
                f"prepare(): {type(model).__name__} has gradient checkpointing on, and precision "
                f"{self._precision.name!r} cannot train it: {self._precision.recompute_refusal}"
            )
        model = self._strategy.wrap_model(model, self._precision)
        # the forward under autocast, and through DDP's wrapper where the strategy has one (it arms the sync)
        patch_forward(model, self._precision, self._strategy.training_forward(model))
        self._precision.register_param_names(model.named_parameters())
        self.registry.models.append(model)
        if self._watch is not None:
            self._watch.attach(self._host, model)
        return model

    def prepared_here(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` was prepared by this Accelerator (not another one, not at all)."""
        return any(m is model for m in self.registry.models)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """``optimizer`` converted for the precision (fp32 masters of 16-bit weights; bf16-pure's Bf16AdamW) and
        stepped through its loss scaler: ``step()`` unscales, checks and skips a non-finite step, and does nothing
        while accumulating."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        for prepared in self.registry.optimizers:  # prepared before: one wrapper, or two would unscale apart
            if optimizer is prepared.source:
                return prepared
        self._strategy.follow_replaced_parameters(optimizer)  # FSDP2: the sharded parameters
        converted = self._precision.convert_optimizer(optimizer)
        fence = self._fence
        stepper = BackwardStepper(converted, self._precision, fence) if self._step_in_backward else None
        prepared = PreparedOptimizer(converted, self._gradients, source=optimizer, stepper=stepper, fence=fence)
        if self._watch is not None:
            self._watch.watch_optimizer(converted)
        self.registry.optimizers.append(prepared)
        self._gradients.optimizers.append(prepared)
        self._gradients.forget_owners()
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        """``scheduler``, advanced as accelerate's: not while accumulating, nor after a skipped step."""
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        for prepared in self.registry.schedulers:  # prepared before: one wrapper, or it would step twice
            if scheduler is prepared.scheduler:
                return prepared
        target = getattr(scheduler, "optimizer", None)
        owners = [o for o in self.registry.optimizers if target in (o, o.optimizer, o.source)]
        prepared = PreparedScheduler(scheduler, owners, self._gradients, fence=self._fence, **self._scheduler_rule)
        self.registry.schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, loader: DataLoader) -> PreparedDataLoader:
        """``loader``, its batches on the device (and split across processes when there are several)."""
        if isinstance(loader, PreparedDataLoader):
            return loader
        prepared = prepare_dataloader(
            loader, self._strategy, self._gradients, self._non_blocking, self._dispatch_batches
        )
        self.registry.dataloaders.append(prepared)
        return prepared

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module (``prepare`` already returns it; this also unwraps DDP/DataParallel). With
        ``keep_fp32_wrapper=False`` its forward loses the precision's autocast, in place, as in accelerate;
        ``keep_torch_compile=False`` also unwraps ``torch.compile``."""
        return unwrap(model, keep_fp32_wrapper, keep_torch_compile)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader``'s next epoch from batch ``num_batches`` (accelerate's mid-epoch resume). For a
        prepared loader the count is from the epoch's start, so a script that calls this after ``load_state``
        (which already restores the loader's position) does not skip twice. See
        :func:`~mixprec.loaders.data.skip_first_batches`."""
        return skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared model, optimizer, scheduler and DataLoader, collect garbage and empty the
        device's cache; returns ``[None] * len(objects)`` to assign back (``model, opt = free_memory(model,
        opt)``), as accelerate. Objects registered for checkpointing are kept (a precision watch among them
        still holds the model it watches). A model prepared here before can be prepared again."""
        for optimizer in self.registry.optimizers:
            if optimizer.stepper is not None:  # step_in_backward: the parameters stop stepping this optimizer
                optimizer.stepper.remove()
        self.registry.models.clear()
        self.registry.optimizers.clear()
        self.registry.schedulers.clear()
        self.registry.dataloaders.clear()
        self._gradients.forget_optimizers()
        self._precision.forget_parameters()
        gc.collect()
        device = self._strategy.device
        empty = getattr(getattr(torch, device.type, None), "empty_cache", None)
        if device.type != "cpu" and callable(empty):
            empty()
        return [None for _ in objects]

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step of any prepared optimizer was skipped for inf/NaN gradients (no host sync)."""
        return any(opt.step_was_skipped for opt in self.registry.optimizers)


def object_kind(obj: Any, index: int) -> str:
    """ "model", "optimizer", "scheduler", "dataloader", or "none" for anything else, which ``prepare``
    returns unchanged as accelerate does (None silently; other objects with a warning naming the argument).
    A Dataset is a TypeError: it would go through unsharded and undevice'd, which no script means."""
    if obj is None:
        return "none"
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (DataLoader, PreparedDataLoader)):
        return "dataloader"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, PreparedScheduler)) or (
        hasattr(obj, "optimizer") and callable(getattr(obj, "step", None)) and hasattr(obj, "state_dict")
    ):
        return "scheduler"
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, Dataset):
        raise TypeError(
            f"prepare() got a Dataset ({kind}, argument {index}); wrap it in a torch.utils.data.DataLoader "
            "and prepare that, so that it is sharded across processes and its batches moved to the device"
        )
    warnings.warn(
        f"prepare() returns argument {index} ({kind}) unchanged: it prepares {_ACCEPTED}",
        UserWarning,
        stacklevel=3,
    )
    return "none"


def check_preparable(model: torch.nn.Module) -> None:
    """Refuse a model transformers loaded in 8 or 4 bits (bitsandbytes) with parts placed on the CPU or disk
    (``hf_device_map``): its offloaded weights have no gradients to step (accelerate refuses it with the same
    ValueError). fp16/bf16 parameters are welcome: frozen ones stay as they are, trainable ones get fp32 masters
    when the optimizer is prepared (:mod:`mixprec.precision.master_weights`)."""
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not isinstance(device_map, dict):
        return
    placed = {str(device) for device in device_map.values()}
    if placed & {"cpu", "disk"}:
        raise ValueError(
            "prepare(): this model was loaded in 8-bit or 4-bit precision with CPU or disk offload "
            f"(hf_device_map places parts on {sorted(placed & {'cpu', 'disk'})}), which cannot be trained; "
            "load it entirely on the training device, e.g. device_map={'': torch.cuda.current_device()}"
        )
