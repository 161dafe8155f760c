"""The Accelerator: the seed's second snippet, for real, in one process or many.

::

    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    for batch in train_dataloader:
        outputs = model(batch["input_ids"], labels=batch["labels"])
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()

A facade that delegates: precision behaviour lives in the precision strategy (``mixprec.precision``), loss
scaling in the scaler, distribution in a distributed strategy (one process, DDP, FSDP2), the accumulation
schedule in :class:`~mixprec.accelerator.gradients.GradientState`. No method branches on the mode.

Launch on several processes with ``torchrun --nproc_per_node=N script.py`` (or ``--nnodes``): the
Accelerator reads the launcher's environment and joins the process group itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from mixprec import wiring
from mixprec.accelerator import accelerate_compat
from mixprec.accelerator.accelerate_compat import SharedState, adopt, autocast_for, read_handlers
from mixprec.accelerator.config import AcceleratorConfig, scheduler_rule
from mixprec.accelerator.gradients import GradientAccumulationPlugin, GradientState
from mixprec.accelerator.lifecycle import check_preparable, object_kind
from mixprec.accelerator.outputs import OutputMethods
from mixprec.accelerator.prepared import (
    PreparedOptimizer,
    PreparedScheduler,
    is_prepared,
    patch_forward,
    prepared_with,
    unwrap,
)
from mixprec.accelerator.processes import ProcessMethods
from mixprec.accelerator.project import ProjectConfiguration
from mixprec.accelerator.step_in_backward import REFUSALS, BackwardStepper
from mixprec.checkpoint.folder_checks import Registry
from mixprec.checkpoint.manager import CheckpointManager
from mixprec.loaders.data import PreparedDataLoader, prepare_dataloader, skip_first_batches
from mixprec.loaders.data_config import DataLoaderConfiguration
from mixprec.precision.base import Precision
from mixprec.precision.decision import AutoDecision
from mixprec.precision.registry import precision_for
from mixprec.scaling.scaler import GradScaler
from mixprec.strategies.launch_env import LaunchEnv, select_device
from mixprec.strategies.process_state import AcceleratorState
from mixprec.strategies.registry import make_strategy
from mixprec.strategies.strategy import DistributedStrategy
from mixprec.tracking.trackers import Trackers

logger = logging.getLogger("mixprec.accelerator")


class Accelerator(ProcessMethods, OutputMethods):
    """Mixed precision, loss scaling, gradient accumulation and distribution for a hand-written loop.

    Args: see :class:`~mixprec.accelerator.config.AcceleratorConfig` (``mixed_precision=None``: what
    ``accelerate launch`` set, else "no", as HF Accelerate). Raises ValueError for an unknown precision name
    (listing the valid ones) and :class:`~mixprec.precision.base.PrecisionNotSupportedError` for a mode the
    device cannot run.
    ``watch``: a precision watch for the prepared model (``50``, ``"fallback"``, a ``PrecisionWatch``...; see
    :mod:`mixprec.watch.settings`), reachable as ``accelerator.watch``; off (None) by default.
    ``project_dir`` / ``project_config``: where ``save_state()`` with no path writes (see
    :class:`~mixprec.accelerator.project.ProjectConfiguration`). ``gradient_accumulation_plugin``: a
    :class:`~mixprec.accelerator.gradients.GradientAccumulationPlugin`, instead of ``gradient_accumulation_steps``.
    ``dataloader_config``: accelerate's :class:`~mixprec.loaders.data_config.DataLoaderConfiguration`
    (the settings that mean mixprec's own split are accepted, the others refused by name).
    accelerate's own ``ProjectConfiguration`` / ``GradientAccumulationPlugin`` / ``DataLoaderConfiguration`` are
    taken too, and ``kwargs_handlers=[GradScalerKwargs(...), DistributedDataParallelKwargs(...), ...]`` become
    the arguments they mean (:mod:`~mixprec.accelerator.accelerate_compat`).
    ``comm_dtype``: the dtype gradients travel in between processes ("bf16": half the bytes; see
    :mod:`mixprec.strategies.comm`).
    """

    def __init__(
        self,
        mixed_precision: str | Precision | None = None,
        gradient_accumulation_steps: int = 1,
        distributed: str | None = None,
        device: torch.device | str | None = None,
        cpu: bool = False,
        scaler_kwargs: Mapping[str, Any] | None = None,
        *,
        ddp_kwargs: Mapping[str, Any] | None = None,
        fsdp_shard: Callable[[torch.nn.Module], bool] | None = None,
        fsdp_state_dict_type: str = "full",
        non_blocking: bool = False,
        verbose: bool = True,
        watch: Any = None,
        timeout: float | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        step_in_backward: bool = False,
        log_with: str | list[str] | None = None,
        kwargs_handlers: list[Any] | None = None,
        comm_dtype: Any = None,
        fp32_ops: Sequence[str] | str | None = None,
        step_scheduler_with_optimizer: bool = True,
        split_batches: bool = False,
        scheduler_counts_optimizer_steps: bool = False,
    ) -> None:
        # accelerate's own helper objects, from a script that swapped only its Accelerator (accelerate_compat).
        project_config = adopt(project_config, ProjectConfiguration, "project_config")
        gradient_accumulation_plugin = adopt(
            gradient_accumulation_plugin, GradientAccumulationPlugin, "gradient_accumulation_plugin"
        )
        dataloader_config = adopt(dataloader_config, DataLoaderConfiguration, "dataloader_config")
        handled = read_handlers(
            kwargs_handlers, scaler_kwargs=scaler_kwargs, ddp_kwargs=ddp_kwargs, timeout=timeout, comm_dtype=comm_dtype
        )
        if gradient_accumulation_plugin is not None and gradient_accumulation_steps != 1:
            raise ValueError(
                f"Accelerator(gradient_accumulation_steps={gradient_accumulation_steps!r}, "
                "gradient_accumulation_plugin=...): pass only one of gradient_accumulation_steps and "
                "gradient_accumulation_plugin (set num_steps in the plugin)"
            )
        self.profile_handler = handled.profile  # accelerate's ProfileKwargs, for profile()
        self.dataloader_config = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
        non_blocking = non_blocking or self.dataloader_config.non_blocking
        self.config = AcceleratorConfig(
            mixed_precision, gradient_accumulation_steps, distributed, device, cpu, handled.scaler_kwargs or None,
            handled.ddp_kwargs or None, fsdp_shard, non_blocking, verbose, handled.timeout, fsdp_state_dict_type,
            step_in_backward, handled.comm_dtype, fp32_ops, step_scheduler_with_optimizer, split_batches,
            scheduler_counts_optimizer_steps,
        )  # fmt: skip
        env = LaunchEnv.from_environ()
        dev = select_device(self.config.device, self.config.cpu, env)
        # Resolved before joining any process group, so a bad name fails fast and leaves nothing behind.
        # The strategy owns the step (backward, unscale, optimizer step, its scaler); "auto" is decided on
        # the first training step, by racing the candidates on it (mixprec.precision.auto).
        self._precision: Precision = _resolve(self.config.mixed_precision, dev, env.world_size)
        self._strategy = make_strategy(
            self.config.distributed,
            env,
            dev,
            ddp_kwargs=self.config.ddp_kwargs,
            fsdp_shard=self.config.fsdp_shard,
            fsdp_sharded_state=self.config.fsdp_state_dict_type == "sharded",
            timeout=self.config.timeout,
            comm=self.config.comm_dtype,
        )
        self._scheduler_rule = scheduler_rule(self.config, self._strategy.num_processes)
        if self.config.step_in_backward:
            if self._precision.pending or self._precision.needs_loss_scaling:
                raise ValueError(
                    f"Accelerator(mixed_precision={self._precision.name!r}, step_in_backward=True): {REFUSALS['fp16']}"
                )
            if self._strategy.num_processes > 1:
                raise ValueError(f"Accelerator(step_in_backward=True): {REFUSALS['processes']}")
        self._precision.configure(
            self.config.scaler_kwargs,
            self._strategy.found_inf_reducer(),
            agree=self._strategy.agreement([p.name for p in self._precision.options()]),
            is_main=self._strategy.is_main_process,
            announce=self._report,  # "auto", once decided, says what it measured
        )
        self._gradients = GradientState(
            self._precision, self._strategy, self.config.gradient_accumulation_steps, gradient_accumulation_plugin
        )
        self._registry = Registry()
        project = project_config if project_config is not None else ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and project.project_dir is None:
            project.set_directories(project_dir)
        self._checkpoints = CheckpointManager(self._run_state, project)
        self._trackers = Trackers(log_with, project.logging_dir, self._strategy.is_main_process)
        self._trigger = False
        self.state = AcceleratorState(self._strategy, self._precision)
        self._accelerate_state = SharedState.start(
            device=dev, accumulation=self._gradients.plugin_kwargs, timeout=self.config.timeout
        )
        # The precision watch (mixprec.watch, built through the face's wiring: the watch sits above this
        # layer): None when off; it attaches itself to the model in prepare_model, given this Accelerator
        # as its host (mixprec.watch.host.WatchHost).
        self.watch: Any = wiring.watch_for(watch, "Accelerator(watch=...)")
        self._report()

    # -- what was resolved ---------------------------------------------------------------------------

    @property
    def precision(self) -> Precision:
        """The strategy running the step: the named mode's, or "auto"'s choice once made (before that, the
        pending "auto" strategy itself)."""
        return self._precision.resolved

    @property
    def scaler(self) -> GradScaler:
        """The precision's loss scaler (a pass-through with the same interface unless it is fp16)."""
        return self._precision.scaler

    @property
    def mixed_precision(self) -> str:
        """The precision name: "fp32", "fp16" or "bf16"; "auto" only until its race decides."""
        return self._precision.name

    @property
    def precision_pending(self) -> bool:
        """True while "auto" has not yet measured its first training step (see ``settle_precision``)."""
        return self._precision.pending

    @property
    def precision_racing(self) -> bool:
        """True while "auto" races as the run's own first training steps (see ``settle_precision``)."""
        return self._precision.racing

    @property
    def auto_decision(self) -> AutoDecision | None:
        """What "auto" measured and chose (None for a named precision, or before the first training step)."""
        return getattr(self._precision, "decision", None)

    def set_initial_loss_scale(self, scale: float) -> float | None:
        """Start loss scaling at ``scale`` (clamped to the scaler's bounds), before the first step: the fp16
        scaler's, or that of "auto"'s fp16 candidate while it is undecided. Returns the scale applied, or
        None when no mode here scales the loss."""
        applied = None
        for option in self._precision.options():
            if option.needs_loss_scaling:
                option.scaler.update(new_scale=scale)
                applied = option.scaler.get_scale()
        return applied

    def settle_precision(
        self,
        loss_fn: Callable[[], torch.Tensor],
        batch: Any = None,
        *,
        excluded: Mapping[str, str] | None = None,
        run_steps: int | None = None,
        in_run: bool | None = None,
    ) -> AutoDecision | None:
        """precision="auto": race the modes on ``loss_fn`` (a real step's forward, returning its loss; the Trainer
        calls it, a hand-written loop's first training forward does) and keep the fastest safe one. ``run_steps``:
        the run's passes, if known (a budget; a known length races as the steps: ``AutoPrecision.settle``)."""
        return self._precision.settle(
            loss_fn, self._registry.models, batch=batch, excluded=excluded, run_steps=run_steps, in_run=in_run,
            passes_per_step=self.gradient_accumulation_steps,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self._strategy.device

    @property
    def strategy(self) -> DistributedStrategy:
        """How the processes share the work (one process, DDP or FSDP2). Its ``model_state_dict(model)``
        gathers a prepared model's full weights onto the main process (a collective under FSDP2) and
        ``load_model_state_dict(model, read)`` loads full weights back into every process's part."""
        return self._strategy

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._gradients.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if self.config.step_in_backward and steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={steps!r} with step_in_backward=True: {REFUSALS['accumulate']}"
            )
        self._gradients.num_steps = steps
        self._accelerate_state.mirror(num_steps=steps)

    @property
    def sync_gradients(self) -> bool:
        """True on a micro-batch that steps the optimizer (always, without accumulation)."""
        return self._gradients.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._gradients.sync_gradients = bool(value)
        self._accelerate_state.mirror(sync_gradients=bool(value))

    @property
    def gradient_state(self) -> GradientState:
        """The accumulation state (``sync_gradients``, ``end_of_dataloader``, ``num_steps``...)."""
        return self._gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step of any prepared optimizer was skipped for inf/NaN gradients (no host sync)."""
        return any(opt.step_was_skipped for opt in self._registry.optimizers)

    # -- prepare -------------------------------------------------------------------------------------

    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers, in any order; returned in that order
        (a single object when one is passed; None passes through in its place). Models go first, so
        optimizers can follow their parameters."""
        kinds = [object_kind(obj, i) for i, obj in enumerate(objects)]
        result = list(objects)
        steps = (("model", self.prepare_model), ("optimizer", self.prepare_optimizer),
                 ("scheduler", self.prepare_scheduler), ("dataloader", self.prepare_data_loader))  # fmt: skip
        for kind, prepare in steps:
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    result[i] = prepare(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The same module, on the device, its forward under autocast (and DDP/FSDP2 when distributed)."""
        if is_prepared(model):
            if any(m is model for m in self._registry.models):
                return model
            if prepared_with(model) is self._precision:  # prepared here, then dropped by free_memory
                self._registry.models.append(model)
                return model
            raise ValueError(f"{type(model).__name__} was prepared by another Accelerator")
        check_preparable(model)
        model = self._strategy.wrap_model(model, self._precision)
        # the forward under autocast, and through DDP's wrapper where the strategy has one (it arms the sync)
        patch_forward(model, self._precision, self._strategy.training_forward(model))
        self._precision.register_param_names(model.named_parameters())
        self._registry.models.append(model)
        if self.watch is not None:
            self.watch.attach(self, model)
        return model

    def prepared_here(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` was prepared by this Accelerator (not another one, not at all)."""
        return any(m is model for m in self._registry.models)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        self._strategy.follow_replaced_parameters(optimizer)  # FSDP2: the sharded parameters
        converted = self._precision.convert_optimizer(optimizer)
        fence = self._checkpoints.fence  # an asynchronous save's copy of the weights: steps wait for it
        stepper = BackwardStepper(converted, self._precision, fence) if self.config.step_in_backward else None
        prepared = PreparedOptimizer(converted, self._gradients, source=optimizer, stepper=stepper, fence=fence)
        if self.watch is not None:
            self.watch.watch_optimizer(converted)
        self._registry.optimizers.append(prepared)
        self._gradients.optimizers.append(prepared)
        self._gradients.forget_owners()
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        owners = [o for o in self._registry.optimizers if target in (o, o.optimizer, o.source)]
        rule = self._scheduler_rule
        prepared = PreparedScheduler(scheduler, owners, self._gradients, fence=self._checkpoints.fence, **rule)
        self._registry.schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, loader: DataLoader) -> PreparedDataLoader:
        if isinstance(loader, PreparedDataLoader):
            return loader
        prepared = prepare_dataloader(
            loader, self._strategy, self._gradients, self.config.non_blocking, self.dataloader_config.dispatch_batches
        )
        self._registry.dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader``'s next epoch from batch ``num_batches`` (accelerate's mid-epoch resume). For a
        prepared loader the count is from the epoch's start, so a script that calls this after ``load_state``
        (which already restores the loader's position) does not skip twice. See
        :func:`~mixprec.loaders.data.skip_first_batches`."""
        return skip_first_batches(dataloader, num_batches)

    # -- the step ------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled for fp16 and divided by ``gradient_accumulation_steps``. No host sync."""
        self._gradients.backward(loss, **kwargs)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast, for code outside a prepared model's forward (a loss computed apart);
        ``autocast_handler``: accelerate's ``AutocastKwargs`` (``enabled=False`` turns autocast off inside)."""
        return autocast_for(autocast_handler, self._precision)

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager[torch.profiler.profile]:
        """torch.profiler over the block, as accelerate's ``accelerator.profile()``: ``profile_handler`` (or the
        ``ProfileKwargs`` given in ``kwargs_handlers``) builds the profiler; with its ``output_trace_dir``, each
        process writes ``trace_<index>.json`` there."""
        return accelerate_compat.profile(
            profile_handler if profile_handler is not None else self.profile_handler,
            process_index=self.process_index,
            wait_for_everyone=self.wait_for_everyone,
        )

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch: no gradient sync and no optimizer step before the
        ``gradient_accumulation_steps``-th one (or the DataLoader's last batch)."""
        return self._gradients.accumulate(models)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce of ``model`` for the backward passes inside (DDP/FSDP2)."""
        return self._strategy.no_sync(model)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale first (once per step), clip in place, return the total norm of the true gradients (a
        tensor: reading it with ``.item()`` is a host sync)."""
        self._refuse_clipping("clip_grad_norm_")
        return self._gradients.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale first (once per step), then clamp every gradient to ``[-clip_value, clip_value]``."""
        self._refuse_clipping("clip_grad_value_")
        self._gradients.clip_grad_value_(parameters, clip_value)

    def _refuse_clipping(self, call: str) -> None:
        if self.config.step_in_backward:
            raise ValueError(f"accelerator.{call}() with step_in_backward=True: {REFUSALS['clip']}")

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module (``prepare`` already returns it; this also unwraps DDP/DataParallel). With
        ``keep_fp32_wrapper=False`` its forward loses the precision's autocast, in place, as in accelerate;
        ``keep_torch_compile=False`` also unwraps ``torch.compile``."""
        return unwrap(model, keep_fp32_wrapper, keep_torch_compile)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of ``optimizer`` (a prepared one, or a list; default: every prepared one) for
        a custom clip or inspection; at most once per step, and the step then does not unscale again."""
        chosen = None if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
        self._gradients.unscale_optimizers(chosen)

    def __repr__(self) -> str:
        return (
            f"Accelerator(mixed_precision={self.mixed_precision!r}, device={str(self.device)!r}, "
            f"distributed={self._strategy.name!r}, num_processes={self.num_processes})"
        )


def _resolve(name: str | Precision, device: torch.device, processes: int) -> Precision:
    """The precision registry's answer (a strategy passed in is used as it is), with the argument named in
    the message."""
    try:
        return precision_for(name, device, processes=processes)
    except ValueError as err:  # PrecisionNotSupportedError too: keep its type
        raise type(err)(f"Accelerator(mixed_precision={name!r}): {err}") from None
