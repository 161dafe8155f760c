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

A facade over parts it owns, each with its own state (as Fabric's over its strategy and precision): the class
body names each public member and the part that does it (see :mod:`mixprec.accelerator`); none branches.

Launch on several processes with ``torchrun --nproc_per_node=N script.py`` (or ``--nnodes``): the
Accelerator reads the launcher's environment and joins the process group itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mixprec.accelerator import accelerate_compat
from mixprec.accelerator.accelerate_compat import SharedState, accumulation_plugin, adopt, autocast_for, read_handlers
from mixprec.accelerator.config import AcceleratorConfig, named_argument, run_context
from mixprec.accelerator.delegation import delegate
from mixprec.accelerator.gradients import GradientAccumulationPlugin, GradientState
from mixprec.accelerator.preparation import Preparation
from mixprec.accelerator.processes import Processes
from mixprec.accelerator.project import ProjectConfiguration
from mixprec.accelerator.run_files import RunFiles
from mixprec.accelerator.step_in_backward import REFUSALS, refuse_step_in_backward
from mixprec.checkpoint.folder_checks import Registry, RunState
from mixprec.checkpoint.manager import CheckpointManager
from mixprec.loaders.data_config import DataLoaderConfiguration
from mixprec.precision.base import Precision
from mixprec.precision.decision import AutoDecision
from mixprec.precision.registry import policy_name, precision_for
from mixprec.scaling.scaler import GradScaler
from mixprec.strategies.launch_env import LaunchEnv, select_device
from mixprec.strategies.process_state import AcceleratorState
from mixprec.strategies.registry import make_strategy
from mixprec.strategies.strategy import DistributedStrategy
from mixprec.tracking.trackers import Trackers

if TYPE_CHECKING:
    from mixprec.precision.compile_choice import CompileFigures
    from mixprec.watch.host import HostedWatch

logger = logging.getLogger("mixprec.accelerator")


class Accelerator:
    """Mixed precision, loss scaling, gradient accumulation and distribution for a hand-written loop.

    Its settings are the fields of :class:`~mixprec.accelerator.config.AcceleratorConfig`, one docstring each
    (``mixed_precision``: a name, or a :class:`~mixprec.precision.base.Precision` already made; None: what
    ``accelerate launch`` set, else "no", as HF Accelerate). Besides them:

    - ``watch``: the prepared model's precision watch (``accelerator.watch``; None: off): a setting (``50``,
      ``"fallback"``...: :mod:`mixprec.watch.settings`), or a watch already made (a ``PrecisionWatch``, or any
      object with ``attach`` and ``watch_optimizer``: :class:`~mixprec.watch.host.HostedWatch`).
    - ``project_dir`` / ``project_config``: where ``save_state()`` with no path writes
      (:class:`~mixprec.accelerator.project.ProjectConfiguration`).
    - ``gradient_accumulation_plugin``: a :class:`~mixprec.accelerator.gradients.GradientAccumulationPlugin`.
    - ``dataloader_config``: accelerate's :class:`~mixprec.loaders.data_config.DataLoaderConfiguration`.
    - ``kwargs_handlers``: accelerate's ``[GradScalerKwargs(...), DistributedDataParallelKwargs(...), ...]``,
      read as the arguments they mean (:mod:`~mixprec.accelerator.accelerate_compat`); accelerate's own
      ``ProjectConfiguration`` / ``GradientAccumulationPlugin`` / ``DataLoaderConfiguration`` are taken too.
    - ``log_with``: accelerate's experiment trackers (TensorBoard, MLflow, W&B), for ``init_trackers`` / ``log``.

    Raises ValueError for an unknown precision name (listing the valid ones) and
    :class:`~mixprec.precision.base.PrecisionNotSupportedError` for a mode the device cannot run.
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
        gradient_accumulation_plugin = accumulation_plugin(gradient_accumulation_plugin, gradient_accumulation_steps)
        handled = read_handlers(
            kwargs_handlers, scaler_kwargs=scaler_kwargs, ddp_kwargs=ddp_kwargs, timeout=timeout, comm_dtype=comm_dtype
        )
        self.profile_handler = handled.profile  # accelerate's ProfileKwargs, for profile()
        self.dataloader_config = adopt(dataloader_config, DataLoaderConfiguration, "dataloader_config") or (
            DataLoaderConfiguration()
        )
        non_blocking = non_blocking or self.dataloader_config.non_blocking
        given = mixed_precision if isinstance(mixed_precision, Precision) else None  # the edge: made before, kept
        if given is not None:
            named_argument(lambda: policy_name(given.name, fp32_ops, made=given), fp32_ops, "fp32_ops")
        self.config = AcceleratorConfig(
            mixed_precision if given is None else given.name,
            gradient_accumulation_steps,
            distributed,
            device,
            cpu,
            handled.scaler_kwargs or None,
            handled.ddp_kwargs or None,
            fsdp_shard,
            non_blocking,
            verbose,
            handled.timeout,
            fsdp_state_dict_type,
            step_in_backward,
            handled.comm_dtype,
            fp32_ops,
            step_scheduler_with_optimizer,
            split_batches,
            scheduler_counts_optimizer_steps,
        )
        env = LaunchEnv.from_environ()
        dev = select_device(self.config.device, self.config.cpu, env)
        spec = given if given is not None else self.config.mixed_precision  # before any process group: fails fast
        self._precision: Precision = named_argument(lambda: precision_for(spec, dev, processes=env.world_size), spec)
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
        if self.config.step_in_backward:
            refuse_step_in_backward(self._precision, self._strategy.num_processes)
        self._precision.configure(
            self.config.scaler_kwargs,
            self._strategy.found_inf_reducer(),
            agree=self._strategy.agreement(),
            is_main=self._strategy.is_main_process,
            run=run_context(self.config, self._strategy),  # the precision says the run's line (auto: once decided)
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
        self.state = AcceleratorState(self._strategy, self._precision)
        self._processes = Processes(self.state, self._strategy)
        self._files = RunFiles(self._checkpoints, self._registry, self._strategy, self._processes)
        self._prepared = Preparation(
            self._registry,
            self._strategy,
            self._precision,
            self._gradients,
            self.config,
            self.dataloader_config,
            fence=self._checkpoints.fence,  # an asynchronous save's copy of the weights: steps wait for it
            host=self,  # the precision watch's host
        )
        self._accelerate_state = SharedState.start(
            device=dev, accumulation=self._gradients.plugin_kwargs, timeout=self.config.timeout
        )
        self.watch: HostedWatch | None = watch if watch is None or hasattr(watch, "attach") else _built_watch(watch)
        self._precision.announce()

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
        return not (self._precision.pending or self._precision.decided)  # deciding on the steps themselves

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

    def settle_precision(self, loss_fn: Callable[[], torch.Tensor], batch: Any = None, **facts: Any) -> Any:
        """Decide a precision still to be decided ("auto") on ``loss_fn`` (one forward of a real batch, returning its
        loss), told ``facts`` (``run_steps``: the run's passes, ``unsafe_formats``; :meth:`~mixprec.Precision.settle`).
        The Trainer calls it; a loop's first forward decides aside (call this first to race in-run). Returns it."""
        return self._precision.settle(
            loss_fn, self._registry.models, batch=batch, passes_per_step=self.gradient_accumulation_steps, **facts
        )

    def note_compile(self, figures: CompileFigures) -> None:
        """Record what compiling cost and whether it was kept (the Trainer's compile gate calls it): "auto"'s
        decision and cache keep the figures, for the next run's verdict; a named precision keeps none."""
        self._precision.note_compile(figures)  # not a delegate: auto overrides the base's no-op

    @property
    def device(self) -> torch.device:
        """This process's device: where prepared models, batches and the loss scaler live."""
        return self._strategy.device

    @property
    def strategy(self) -> DistributedStrategy:
        """How the processes share the work (one process, DDP or FSDP2). Its ``model_state_dict(model)``
        gathers a prepared model's full weights onto the main process (a collective under FSDP2) and
        ``load_model_state_dict(model, read)`` loads full weights back into every process's part."""
        return self._strategy

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (``accumulate``; ``backward`` divides the loss by it); settable."""
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

    optimizer_step_was_skipped = delegate("_prepared", Preparation.optimizer_step_was_skipped)

    # -- prepare, and what it registered: the preparation part ----------------------------------------

    prepare = delegate("_prepared", Preparation.prepare)
    prepare_model = delegate("_prepared", Preparation.prepare_model)
    prepare_optimizer = delegate("_prepared", Preparation.prepare_optimizer)
    prepare_scheduler = delegate("_prepared", Preparation.prepare_scheduler)
    prepare_data_loader = delegate("_prepared", Preparation.prepare_data_loader)
    prepared_here = delegate("_prepared", Preparation.prepared_here)
    unwrap_model = delegate("_prepared", Preparation.unwrap_model)
    skip_first_batches = delegate("_prepared", Preparation.skip_first_batches)
    free_memory = delegate("_prepared", Preparation.free_memory)
    clear = free_memory
    watch = delegate("_prepared", Preparation.watch)

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

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of ``optimizer`` (a prepared one, or a list; default: every prepared one) for
        a custom clip or inspection; at most once per step, and the step then does not unscale again."""
        chosen = None if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
        self._gradients.unscale_optimizers(chosen)

    # -- where this process stands and who runs what: the process state (accelerator.state) ------------

    distributed_type = delegate("state", AcceleratorState.distributed_type)
    num_processes = delegate("state", AcceleratorState.num_processes)
    process_index = delegate("state", AcceleratorState.process_index)
    local_process_index = delegate("state", AcceleratorState.local_process_index)
    is_main_process = delegate("state", AcceleratorState.is_main_process)
    is_local_main_process = delegate("state", AcceleratorState.is_local_main_process)
    is_last_process = delegate("state", AcceleratorState.is_last_process)
    use_distributed = delegate("state", AcceleratorState.use_distributed)
    wait_for_everyone = delegate("state", AcceleratorState.wait_for_everyone)
    main_process_first = delegate("state", AcceleratorState.main_process_first)
    local_main_process_first = delegate("state", AcceleratorState.local_main_process_first)
    split_between_processes = delegate("state", AcceleratorState.split_between_processes)
    on_main_process = delegate("state", AcceleratorState.on_main_process)
    on_local_main_process = delegate("state", AcceleratorState.on_local_main_process)
    on_last_process = delegate("state", AcceleratorState.on_last_process)
    on_process = delegate("state", AcceleratorState.on_process)
    print = delegate("state", AcceleratorState.print)

    # -- collectives, and a flag any process can raise: the processes part -----------------------------

    gather = delegate("_processes", Processes.gather)
    gather_for_metrics = delegate("_processes", Processes.gather_for_metrics)
    pad_across_processes = delegate("_processes", Processes.pad_across_processes)
    reduce = delegate("_processes", Processes.reduce)
    explain_failure = delegate("_processes", Processes.explain_failure)
    set_trigger = delegate("_processes", Processes.set_trigger)
    check_trigger = delegate("_processes", Processes.check_trigger)
    save = delegate("_processes", Processes.save)

    # -- checkpoints and weights on disk: the files part, which asks the checkpoint manager ------------

    checkpoints = delegate("_files", RunFiles.checkpoints)
    save_state = delegate("_files", RunFiles.save_state)
    load_state = delegate("_files", RunFiles.load_state)
    wait_for_checkpoint = delegate("_files", RunFiles.wait_for_checkpoint)
    resume_after_restart = delegate("_files", RunFiles.resume_after_restart)
    register_for_checkpointing = delegate("_files", RunFiles.register_for_checkpointing)
    register_save_state_pre_hook = delegate("_files", RunFiles.register_save_state_pre_hook)
    register_load_state_pre_hook = delegate("_files", RunFiles.register_load_state_pre_hook)
    project_configuration = delegate("_files", RunFiles.project_configuration)
    project_dir = delegate("_files", RunFiles.project_dir)
    logging_dir = delegate("_files", RunFiles.logging_dir)
    save_iteration = delegate("_files", RunFiles.save_iteration)
    save_model = delegate("_files", RunFiles.save_model)
    get_state_dict = delegate("_files", RunFiles.get_state_dict)

    # -- experiment trackers (accelerate's log_with): the trackers part -------------------------------

    init_trackers = delegate("_trackers", Trackers.init_trackers)
    log = delegate("_trackers", Trackers.log)
    get_tracker = delegate("_trackers", Trackers.get_tracker)
    trackers = delegate("_trackers", Trackers.trackers)

    def end_training(self) -> None:
        """Finish the trackers, then leave the process group this Accelerator joined (call at the end of a
        distributed script), once every process has reached this call. An asynchronous save still in flight
        is finished first (its failure raised after the group is left)."""
        try:
            self._checkpoints.wait()
        finally:
            self._trackers.finish()
            self._strategy.close(wait_for_peers=True)

    # accelerate's names for what prepare() registered, read by scripts written for it (free_memory empties them)
    _models = property(lambda self: self._registry.models)
    _optimizers = property(lambda self: self._registry.optimizers)
    _schedulers = property(lambda self: self._registry.schedulers)
    _dataloaders = property(lambda self: self._registry.dataloaders)

    def _run_state(self) -> RunState:
        return RunState(self._registry, self._strategy, self._precision, self._gradients)

    def __repr__(self) -> str:
        return (
            f"Accelerator(mixed_precision={self.mixed_precision!r}, device={str(self.device)!r}, "
            f"distributed={self._strategy.name!r}, num_processes={self.num_processes})"
        )


def _built_watch(setting: Any) -> HostedWatch | None:
    """The precision watch a setting asks for (``watch=50``, ``"fallback"``, a dict...; None when off)."""
    from mixprec.watch.watch import PrecisionWatch  # deferred: the watch loads only for a run that asks for one

    return PrecisionWatch.build(setting, "Accelerator(watch=...)")
