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

import builtins
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader

from mixprec.accelerator import profiling
from mixprec.accelerator.accelerate_compat import SharedState, adopt, autocast_for, read_handlers
from mixprec.accelerator.checkpoints import StateCheckpoints, check_checkpointable
from mixprec.accelerator.config import AcceleratorConfig
from mixprec.accelerator.data import PreparedDataLoader, prepare_dataloader, skip_first_batches
from mixprec.accelerator.data_config import DataLoaderConfiguration
from mixprec.accelerator.distributed import DistributedStrategy, LaunchEnv, make_strategy, select_device
from mixprec.accelerator.gradients import GradientAccumulationPlugin, GradientState
from mixprec.accelerator.lifecycle import object_kind, release_prepared
from mixprec.accelerator.model_checks import check_preparable
from mixprec.accelerator.prepared import PreparedOptimizer, PreparedScheduler, is_prepared, prepared_with, unwrap
from mixprec.accelerator.process_state import AcceleratorState
from mixprec.accelerator.project import ProjectConfiguration
from mixprec.accelerator.restarts import agree_on_number, restarted_anywhere
from mixprec.accelerator.saving import save_model
from mixprec.accelerator.state import Registry, RunState
from mixprec.accelerator.step_in_backward import REFUSALS, BackwardStepper
from mixprec.accelerator.trackers import Trackers
from mixprec.precision.base import Precision
from mixprec.precision.race import AutoDecision
from mixprec.precision.registry import precision_for
from mixprec.scaling.scaler import GradScaler
from mixprec.watch.watch import PrecisionWatch

logger = logging.getLogger("mixprec.accelerator")


def _print_line(line: str) -> None:
    """``line`` on stderr on a line of its own: through tqdm when one of its bars is drawn on the terminal
    (it clears the bar, prints, redraws), else a plain print (the Trainer draws no bar into a file)."""
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if bars:
        tqdm.tqdm.write(line, file=sys.stderr)  # type: ignore[union-attr]
        sys.stderr.flush()
    else:
        builtins.print(line, file=sys.stderr, flush=True)


class Accelerator:
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
    ``dataloader_config``: accelerate's :class:`~mixprec.accelerator.data_config.DataLoaderConfiguration`
    (the settings that mean mixprec's own split are accepted, the others refused by name).
    accelerate's own ``ProjectConfiguration`` / ``GradientAccumulationPlugin`` / ``DataLoaderConfiguration`` are
    taken too, and ``kwargs_handlers=[GradScalerKwargs(...), DistributedDataParallelKwargs(...), ...]`` become
    the arguments they mean (:mod:`~mixprec.accelerator.accelerate_compat`).
    ``comm_dtype``: the dtype gradients travel in between processes ("bf16": half the bytes; see
    :mod:`mixprec.accelerator.comm`).
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
            step_in_backward, handled.comm_dtype, fp32_ops,
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
            agree=_agree_from_main(self._strategy, [p.name for p in self._precision.options()]),
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
        self._checkpoints = StateCheckpoints(project)
        self._trackers = Trackers(log_with, project.logging_dir, self._strategy.is_main_process)
        self._trigger = False
        self.state = AcceleratorState(self._strategy, self._precision)
        self._accelerate_state = SharedState.start(
            device=dev, accumulation=self._gradients.plugin_kwargs, timeout=self.config.timeout
        )
        # The precision watch (mixprec.watch): None when off; attaches to the model in prepare_model.
        self.watch: PrecisionWatch | None = PrecisionWatch.build(watch, "Accelerator(watch=...)")
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
        """The precision name: "fp32", "fp16" or "bf16"; "auto" only until its first training step."""
        return self._precision.name

    @property
    def precision_pending(self) -> bool:
        """True while "auto" has not yet measured its first training step (see ``settle_precision``)."""
        return self._precision.pending

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
    ) -> AutoDecision | None:
        """For precision="auto": race the candidate modes on ``loss_fn`` (the forward of one real training
        step through a prepared model, returning its loss) and keep the fastest safe one, now. Nothing of
        the race reaches training (gradients, buffers and RNG states are restored). The Trainer calls it
        before its first step; a hand-written loop need not (its first training forward does it). A no-op
        for a named precision, or once decided. Costs a few forward+backward passes, once per run: at most a
        small share of it when ``run_steps`` (the run's length in steps) is given."""
        return self._precision.settle(
            loss_fn, self._registry.models, batch=batch, excluded=excluded, run_steps=run_steps
        )

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
    def distributed_type(self) -> str:
        """ "single", "ddp" or "fsdp"."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

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

    # accelerate's names for what prepare() registered, which scripts and libraries written for it read
    # (the lists themselves: free_memory empties them).
    @property
    def _models(self) -> list[torch.nn.Module]:
        return self._registry.models

    @property
    def _optimizers(self) -> list[PreparedOptimizer]:
        return self._registry.optimizers

    @property
    def _schedulers(self) -> list[PreparedScheduler]:
        return self._registry.schedulers

    @property
    def _dataloaders(self) -> list[PreparedDataLoader]:
        return self._registry.dataloaders

    @property
    def gradient_state(self) -> GradientState:
        """The accumulation state (``sync_gradients``, ``end_of_dataloader``, ``num_steps``...)."""
        return self._gradients

    @property
    def project_configuration(self) -> ProjectConfiguration:
        return self._checkpoints.project

    @property
    def project_dir(self) -> str | os.PathLike[str] | None:
        return self._checkpoints.project.project_dir

    @property
    def logging_dir(self) -> str | os.PathLike[str] | None:
        return self._checkpoints.project.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets."""
        return self._checkpoints.project.iteration

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step of any prepared optimizer was skipped for inf/NaN gradients (no host sync)."""
        return any(opt.step_was_skipped for opt in self._registry.optimizers)

    def _report(self) -> None:
        d = self._precision.describe()
        if self._precision.pending:  # said once, when decided (issue 29: one story per run)
            logger.info("mixprec: auto on %s, %s: %s", d["device"], self._strategy.describe(), d["reason"])
            return
        line = (
            f"mixprec: {d['precision']} on {d['device']} (compute {d['compute_dtype']}, master weights "
            f"{d['param_dtype']}, loss scaling {'on' if d['loss_scaling'] else 'off'}), "
            f"{self._strategy.describe()}: {d['reason']}"
        )
        if self.config.step_in_backward:
            line += "; optimizer steps in backward (each gradient freed once applied)"
        self._say(line)

    def _say(self, line: str) -> None:
        if self.is_main_process:
            logger.info(line)
            if self.config.verbose:
                _print_line(line)

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
        replaced = self._strategy.replaced_parameters()
        if replaced:
            _follow_replaced_parameters(optimizer, replaced)
        converted = self._precision.convert_optimizer(optimizer)
        stepper = BackwardStepper(converted, self._precision) if self.config.step_in_backward else None
        prepared = PreparedOptimizer(converted, self._gradients, source=optimizer, stepper=stepper)
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
        prepared = PreparedScheduler(scheduler, owners, self._gradients)
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
        :func:`~mixprec.accelerator.data.skip_first_batches`."""
        return skip_first_batches(dataloader, num_batches)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict()`` / ``load_state_dict()`` in ``save_state`` / ``load_state``.
        Raises ValueError listing every object that lacks them (by position), registering none."""
        check_checkpointable(objects)
        self._registry.custom.extend(objects)

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
        return profiling.profile(
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

    # -- state ---------------------------------------------------------------------------------------

    def save_state(
        self,
        output_dir: str | Path | None = None,
        safe_serialization: bool = True,
        *,
        extra_json: Mapping[str, Any] | None = None,
        async_save: bool = False,
    ) -> Path:
        """Save models, optimizers, schedulers, scaler, data positions and RNG states, atomically (see
        :mod:`mixprec.accelerator.state`); with no ``output_dir``, to the project's next automatic checkpoint
        (:mod:`mixprec.accelerator.project`). ``safe_serialization=False`` writes the weights with torch.save.
        ``extra_json={"name": obj}`` adds ``name.json`` to the folder. Collective: call it on every process.
        ``async_save=True``: returns once the state is copied to host memory; a background thread writes and
        commits the folder (it appears when complete; ``wait_for_checkpoint()`` waits for it)."""
        return self._checkpoints.save(
            self._run_state(), output_dir, safe_serialization=safe_serialization, extra_json=extra_json,
            async_save=async_save,
        )  # fmt: skip

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous ``save_state`` has committed its folder; raise its failure on every
        process. Collective. ``load_state`` and ``end_training`` call it themselves."""
        self._checkpoints.wait(self._run_state())

    def load_state(self, input_dir: str | Path | None = None, *, map_location: str | None = None) -> dict[str, Any]:
        """Restore a folder written by ``save_state`` (either format; with no ``input_dir``, the project's newest
        automatic checkpoint) into the prepared objects (call after ``prepare``). Loads no pickled objects.
        ``map_location`` ("cpu" or "on_device", accelerate's values) is accepted: the state always lands on
        the devices of the parameters it belongs to. Collective."""
        return self._checkpoints.load(self._run_state(), input_dir, map_location=map_location)

    def resume_after_restart(self) -> Path | None:
        """The elastic pattern in one line: when ``torchrun --max-restarts=N`` restarted this worker group (a
        process died; on any node), load the project's newest automatic checkpoint and return its folder;
        otherwise (a first start, or no checkpoint yet) load nothing and return None. The main process chooses
        the folder for all. Needs ``ProjectConfiguration(automatic_checkpoint_naming=True)``. Collective."""
        number = self._checkpoints.latest_number()  # every process checks the configuration; the main one's count
        if not restarted_anywhere(self):
            return None
        number = agree_on_number(self, number)
        if number < 0:
            logger.warning("restarted by the launcher, but no checkpoint was saved yet: starting afresh")
            return None
        folder = self.project_configuration.checkpoint(number)
        self.load_state(folder)
        logger.warning("restarted by the launcher: resumed from %s", folder)
        return folder

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """``hook(models, weights, output_dir)`` before ``save_state`` writes (see
        :mod:`mixprec.accelerator.checkpoints`); returns a handle with ``remove()``."""
        return self._checkpoints.register_save_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """``hook(models, input_dir)`` before ``load_state`` loads; returns a handle with ``remove()``."""
        return self._checkpoints.register_load_hook(hook)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write ``model``'s full weights in the Hugging Face layout (``model.safetensors``, or shards and an
        index; see :mod:`mixprec.accelerator.saving`), gathered through the distributed strategy (FSDP2
        included) and written by the main process. Collective: call it on every process."""
        save_model(self._strategy, self.unwrap_model(model), save_directory,
                   max_shard_size=max_shard_size, safe_serialization=safe_serialization)  # fmt: skip

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """``model``'s full state dict on the main process (gathered under FSDP2: a collective), None on the
        others. ``unwrap`` is accepted for accelerate's scripts: the keys are the user's module's either way."""
        return self._strategy.model_state_dict(self.unwrap_model(model))

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared model, optimizer, scheduler and DataLoader, collect garbage and empty the
        device's cache; returns ``[None] * len(objects)`` to assign back (``model, opt = free_memory(model,
        opt)``), as accelerate. Objects registered for checkpointing are kept (a precision watch among them
        still holds the model it watches). A model prepared here before can be prepared again."""
        release_prepared(self._registry, self._gradients, self._precision, self.device)
        return [None for _ in objects]

    clear = free_memory

    def _run_state(self) -> RunState:
        return RunState(self._registry, self._strategy, self._precision, self._gradients)

    # -- processes -----------------------------------------------------------------------------------

    def gather(self, data: Any) -> Any:
        """Concatenate tensors (nested in dicts/lists) from every process along dim 0; processes may hold
        different numbers of rows. Collective, and a host sync (the row counts)."""
        return _map_tensors(data, self._strategy.all_gather, self.device)

    gather_for_metrics = gather  # the prepared DataLoaders repeat no sample, so there is nothing to drop

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad tensors (nested) along ``dim`` to the longest any process holds, with ``pad_index`` (at the start
        with ``pad_first``), so that they can be gathered: accelerate's, for token-level predictions whose
        sequence lengths differ between processes. Collective (one all-reduce per tensor); a tensor with fewer
        than ``dim + 1`` dimensions is returned as it is, as everything is in one process."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if self.num_processes == 1 or tensor.dim() <= dim:
                return tensor
            length = tensor.shape[dim]
            size = torch.tensor([length], dtype=torch.int64, device=self.device)
            longest = int(self._strategy.all_reduce(size, "max").item())
            if longest == length:
                return tensor
            shape = [*tensor.shape[:dim], longest, *tensor.shape[dim + 1 :]]
            padded = tensor.new_full(shape, pad_index)
            start = longest - length if pad_first else 0
            padded.narrow(dim, start, length).copy_(tensor)
            return padded

        return pytree.tree_map(lambda x: pad(x) if isinstance(x, torch.Tensor) else x, data)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """All-reduce tensors (nested) across processes: "sum", "mean", "max" or "min". Returns new tensors."""
        return _map_tensors(data, lambda t: self._strategy.all_reduce(t.clone(), reduction), self.device)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def explain_failure(self, err: BaseException) -> BaseException:
        """``err`` itself, or, when it is a collective that failed because a peer died or stopped answering
        within ``timeout``, a :class:`~mixprec.accelerator.peers.PeerLostError` naming that rank (asks the
        launcher's store, up to 5 s). ``except Exception as err: raise accelerator.explain_failure(err)``."""
        return self._strategy.explain_failure(err) or err

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The main process runs the block first (downloads, caches), then the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The first process of each machine runs the block first, then the others."""
        return self.state.local_main_process_first()

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """This process's contiguous share of ``inputs`` (see :meth:`PartialState.split_between_processes`)."""
        return self.state.split_between_processes(inputs, apply_padding)

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process only."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``function`` on each machine's first process only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``function`` on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only."""
        return self.state.on_process(function, process_index=process_index)

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    # -- a flag any process can raise (accelerate's trigger: stop every process together) ---------------

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` on every process sees it."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check (then lowered everywhere).
        Collective: every process must call it."""
        raised = not self._strategy.all_true(not self._trigger)
        self._trigger = False
        return raised

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` on the main process only (accelerate's): ``torch.save``, or safetensors for a dict of
        tensors with ``safe_serialization=True``."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in obj.items()}, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of ``optimizer`` (a prepared one, or a list; default: every prepared one) for
        a custom clip or inspection; at most once per step, and the step then does not unscale again."""
        chosen = None if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
        self._gradients.unscale_optimizers(chosen)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        self.state.print(*args, **kwargs)

    # -- experiment trackers (accelerate's log_with) --------------------------------------------------

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Start the ``log_with`` trackers on the main process: TensorBoard under ``logging_dir/project_name``,
        MLflow's experiment or W&B's project named ``project_name``; ``config`` is stored as the run's
        hyperparameters; ``init_kwargs={"wandb": {...}}`` goes to that tracker."""
        self._trackers.init(project_name, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker ``name`` ("tensorboard", "mlflow", "wandb"), or with ``unwrap`` what it wraps (the
        SummaryWriter, the mlflow module, the wandb run)."""
        return self._trackers.get(name, unwrap)

    @property
    def trackers(self) -> list[Any]:
        return list(self._trackers.active)

    def end_training(self) -> None:
        """Finish the trackers, then leave the process group this Accelerator joined (call at the end of a
        distributed script), once every process has reached this call. An asynchronous save still in flight
        is finished first (its failure raised after the group is left)."""
        try:
            self._checkpoints.wait(self._run_state())
        finally:
            self._trackers.finish()
            self._strategy.close(wait_for_peers=True)

    def __repr__(self) -> str:
        return (
            f"Accelerator(mixed_precision={self.mixed_precision!r}, device={str(self.device)!r}, "
            f"distributed={self.distributed_type!r}, num_processes={self.num_processes})"
        )


def _resolve(name: str | Precision, device: torch.device, processes: int) -> Precision:
    """The precision registry's answer (a strategy passed in is used as it is), with the argument named in
    the message."""
    try:
        return precision_for(name, device, processes=processes)
    except ValueError as err:  # PrecisionNotSupportedError too: keep its type
        raise type(err)(f"Accelerator(mixed_precision={name!r}): {err}") from None


def _agree_from_main(strategy: Any, universe: list[str]) -> Callable[[list[str]], list[str]] | None:
    """Under several processes, a function handing every process the main one's choice among ``universe``
    (as a mask, so any sub-list in ``universe``'s order travels): "auto" races in lockstep and decides once."""
    if strategy.num_processes == 1:
        return None

    def agree(names: list[str]) -> list[str]:
        mask = torch.tensor([name in names for name in universe], dtype=torch.int32, device=strategy.device)
        mask = strategy.broadcast(mask, src=0)
        return [name for name, keep in zip(universe, mask.tolist()) if keep]

    return agree


def _follow_replaced_parameters(optimizer: torch.optim.Optimizer, replaced: dict[int, torch.nn.Parameter]) -> None:
    """Point an optimizer built before FSDP2 sharding at the sharded parameters."""
    if optimizer.state:
        raise ValueError(
            "prepare(): under FSDP the optimizer must be prepared before its first step (it already has state "
            "for the unsharded parameters)"
        )
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def _map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x.to(device))  # nccl collectives need device tensors (a no-op on the CPU)
        if isinstance(x, (int, float, bool)):
            return fn(torch.tensor(x, device=device))
        raise TypeError(f"gather/reduce take tensors (or dicts/lists of them), got {type(x).__name__}")

    return pytree.tree_map(leaf, data)
