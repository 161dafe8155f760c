"""``save_state`` / ``load_state``: everything a run needs to continue exactly, in one atomic folder.

Layout (``_1``, ``_2``... for the second, third object of a kind, in the order they were prepared)::

    accelerator.json        format, precision, process count, data positions, accumulation counter
    model.safetensors       the user's module's state_dict (full, also under FSDP)
    optimizer.pt            optimizer state_dict          (torch.load(weights_only=True))
    scheduler.pt            LR scheduler state_dict       (weights_only)
    scaler.json             loss scaler state and its step record
    custom_<i>.pt           objects passed to register_for_checkpointing (weights_only)
    rng_state_<rank>.pt     python/numpy/torch/CUDA generators of each process (weights_only)
    gradients.rank<r>.safetensors   only when saved inside an accumulation window: each process's partial
                            gradient sums (not under FSDP2, which refuses such a save)
    <name>.json             extra_json={"name": ...} (the Trainer's trainer_state.json)

The main process writes the shared parts, each process its RNG state, all into one temporary folder that
the main process renames into place once every process reported success (see
:mod:`mixprec.checkpoint.atomic`): a crash or an error at any point leaves the previous state as it was.
A folder shared by all processes (one machine, or a shared filesystem) is assumed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.checkpoint import (
    CheckpointError,
    abort,
    begin,
    commit,
    load_json,
    load_tensors,
    load_torch,
    recover,
    rng_state,
    save_json,
    save_tensors,
    save_torch,
    set_rng_state,
    temp_path,
)

if TYPE_CHECKING:
    from mixprec.accelerator.data import PreparedDataLoader
    from mixprec.accelerator.distributed import DistributedStrategy
    from mixprec.accelerator.gradients import GradientState
    from mixprec.accelerator.prepared import PreparedOptimizer, PreparedScheduler
    from mixprec.precision.base import Precision

FORMAT = 1
META = "accelerator.json"
_TAG = "mixprec-state"
logger = logging.getLogger("mixprec.accelerator")


@dataclass
class Registry:
    """What ``prepare`` and ``register_for_checkpointing`` registered, in order."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[PreparedOptimizer] = field(default_factory=list)
    schedulers: list[PreparedScheduler] = field(default_factory=list)
    dataloaders: list[PreparedDataLoader] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)

    def owner(self, optimizer: PreparedOptimizer) -> torch.nn.Module | None:
        """The prepared model holding ``optimizer``'s first parameter."""
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        return next((m for m in self.models if any(p is first for p in m.parameters())), None)


@dataclass
class RunState:
    """The parts of an Accelerator that ``save_state`` / ``load_state`` touch."""

    registry: Registry
    strategy: DistributedStrategy
    precision: Precision  # owns the scaler; under "auto", its decision is saved and kept at resume
    gradients: GradientState


def _name(kind: str, index: int, ext: str) -> str:
    return f"{kind}.{ext}" if index == 0 else f"{kind}_{index}.{ext}"


def _grads_name(model_index: int, rank: int) -> str:
    return f"{_name('gradients', model_index, 'rank')}{rank}.safetensors"


def save_state(run: RunState, output_dir: str | Path, extra_json: Mapping[str, Any] | None = None) -> Path:
    """Write the folder atomically on every process; returns its path. Collective: call it on every process."""
    target, reg, strategy = Path(output_dir), run.registry, run.strategy
    main = strategy.is_main_process
    for key in extra_json or {}:
        if not key.isidentifier() or key in ("accelerator", "scaler"):
            raise ValueError(f"save_state(extra_json=...): {key!r} cannot name a file; use a plain identifier")
    # Gather first (collectives under FSDP), write after: a process that fails to write then cannot leave the
    # others waiting in a collective.
    models = [strategy.model_state_dict(m) for m in reg.models]
    optimizers = [strategy.optimizer_state_dict(reg.owner(o), o.optimizer) for o in reg.optimizers]
    partial = run.gradients.micro_step > 0  # inside an accumulation window: the gradient sums are state too
    if partial and not strategy.saves_partial_gradients:
        raise CheckpointError(
            f"save_state inside an accumulation window ({run.gradients.micro_step} of "
            f"{run.gradients.accumulation_steps} micro-batches summed) is not supported under {strategy.name}: "
            "save right after an optimizer step (when accelerator.sync_gradients is True)"
        )
    tmp = temp_path(target, _TAG)
    error: BaseException | None = None
    if main:
        try:
            tmp = begin(target, tag=_TAG)
        except Exception as err:
            error = err
    _agree(strategy, error, target, tmp if error is None else None)  # also: the folder exists for everyone
    try:
        if main:
            _write_shared(run, tmp, models, optimizers, extra_json or {})
        save_torch(rng_state(), tmp / f"rng_state_{strategy.process_index}.pt")
        for i, model in enumerate(reg.models if partial else []):  # local (unsynced) sums: one file per process
            grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
            save_tensors(grads, tmp / _grads_name(i, strategy.process_index))
    except Exception as err:  # reported to the other processes, then re-raised
        error = err
    _agree(strategy, error, target, tmp)
    if main:
        commit(tmp, target)
    strategy.barrier()
    return target


def _agree(strategy: DistributedStrategy, error: BaseException | None, target: Path, tmp: Path | None) -> None:
    """Raise on every process if any process failed (the main one then throws the unfinished folder away)."""
    if strategy.all_true(error is None):
        return
    if strategy.is_main_process and tmp is not None:
        abort(tmp)
    if error is not None:
        raise error
    raise CheckpointError(
        f"save_state({str(target)!r}): another process failed to write its part; the previous state is intact"
    )


def _write_shared(
    run: RunState, tmp: Path, models: list[Any], optimizers: list[Any], extra_json: Mapping[str, Any]
) -> None:
    reg = run.registry
    for i, state in enumerate(models):
        save_tensors(state, tmp / _name("model", i, "safetensors"))
    for i, state in enumerate(optimizers):
        save_torch(state, tmp / _name("optimizer", i, "pt"))
    for i, scheduler in enumerate(reg.schedulers):
        save_torch(scheduler.state_dict(), tmp / _name("scheduler", i, "pt"))
    for i, obj in enumerate(reg.custom):
        save_torch(obj.state_dict(), tmp / f"custom_{i}.pt")
    save_json(run.precision.state_dict(), tmp / "scaler.json")
    for key, value in extra_json.items():
        save_json(value, tmp / f"{key}.json")
    save_json(
        {
            "format": FORMAT,
            "mixed_precision": run.precision.name,
            "auto": run.precision.decision_record(),  # "auto"'s measurement: a resume keeps it, unmeasured
            "distributed": run.strategy.name,
            "num_processes": run.strategy.num_processes,
            "counts": _counts(reg),
            "dataloaders": [loader.state_dict() for loader in reg.dataloaders],
            "gradients": run.gradients.state_dict(),
            "torch_version": torch.__version__,
        },
        tmp / META,
    )


def _counts(reg: Registry) -> dict[str, int]:
    return {
        "models": len(reg.models),
        "optimizers": len(reg.optimizers),
        "schedulers": len(reg.schedulers),
        "dataloaders": len(reg.dataloaders),
        "custom": len(reg.custom),
    }


def load_state(run: RunState, input_dir: str | Path) -> dict[str, Any]:
    """Restore what :func:`save_state` wrote into the prepared objects; returns the metadata.
    Collective: call it on every process, after ``prepare``."""
    path, reg, strategy = Path(input_dir), run.registry, run.strategy
    if strategy.is_main_process:
        recover(path)  # finish a save that crashed between its two renames
    strategy.barrier()
    if not (path / META).is_file():
        raise FileNotFoundError(
            f"load_state({str(path)!r}): no {META} there, so it is not a folder written by save_state"
        )
    meta = load_json(path / META)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / META}: format {meta.get('format')!r}, this mixprec reads {FORMAT}")
    saved, now = meta["counts"], _counts(reg)
    for kind in ("models", "optimizers", "schedulers"):
        if saved[kind] != now[kind]:
            raise ValueError(
                f"load_state({str(path)!r}): the state holds {saved[kind]} {kind}, this Accelerator prepared "
                f"{now[kind]}; prepare the same objects (in the same order) before load_state"
            )
    run.precision.adopt_recorded(meta["mixed_precision"], meta.get("auto"))  # before the scaler state: it is the mode's
    for i, model in enumerate(reg.models):
        file = path / _name("model", i, "safetensors")
        strategy.load_model_state_dict(model, lambda file=file: load_tensors(file))
    for i, optimizer in enumerate(reg.optimizers):
        file = path / _name("optimizer", i, "pt")
        strategy.load_optimizer_state_dict(
            reg.owner(optimizer), optimizer.optimizer, lambda file=file: load_torch(file)
        )
    for i, scheduler in enumerate(reg.schedulers):
        scheduler.load_state_dict(load_torch(path / _name("scheduler", i, "pt")))
    for i, obj in enumerate(reg.custom[: saved.get("custom", 0)]):
        obj.load_state_dict(load_torch(path / f"custom_{i}.pt"))
    run.precision.load_state_dict(load_json(path / "scaler.json"))  # a disabled scaler keeps its step record too
    for loader, position in zip(reg.dataloaders, meta["dataloaders"]):
        if position is not None:
            loader.load_state_dict(position)
    run.gradients.load_state_dict(meta["gradients"])
    for i, model in enumerate(reg.models):
        _restore_gradients(model, path / _grads_name(i, strategy.process_index))
    _restore_rng(path, strategy, int(meta["num_processes"]))
    strategy.barrier()
    return meta


def _restore_gradients(model: torch.nn.Module, file: Path) -> None:
    """Gradient sums of an unfinished accumulation window, or none (a state saved at a step boundary)."""
    grads = load_tensors(file) if file.is_file() else {}
    for name, p in model.named_parameters():
        p.grad = grads[name].to(device=p.device, dtype=p.dtype) if name in grads else None


def _restore_rng(path: Path, strategy: DistributedStrategy, saved_processes: int) -> None:
    file = path / f"rng_state_{strategy.process_index}.pt"
    if saved_processes != strategy.num_processes:
        logger.warning(
            "load_state: the state was saved by %d processes, now %d; random generators of process "
            "%d are restored only where it had a counterpart",
            saved_processes,
            strategy.num_processes,
            strategy.process_index,
        )
    if file.is_file():
        set_rng_state(load_torch(file))
