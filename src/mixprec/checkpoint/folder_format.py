"""``save_state`` / ``load_state``: everything a run needs to continue exactly, in one atomic folder.

Layout (``_1``, ``_2``... for the second, third object of a kind, in the order they were prepared)::

    accelerator.json        format, precision, process count, data positions, accumulation counter
    model.safetensors       the user's module's state_dict (full, also under FSDP; a peft model's trainable
                            parameters only: checkpoint/model_part.py); ``pytorch_model.bin``
                            instead with ``safe_serialization=False`` (torch.save, read back weights_only)
    optimizer.pt            optimizer state_dict          (torch.load(weights_only=True))
    scheduler.pt            LR scheduler state_dict       (weights_only)
    scaler.json             loss scaler state and its step record
    custom_<i>.pt           objects passed to register_for_checkpointing (weights_only)
    rng_state_<rank>.pt     python/numpy/torch/CUDA generators of each process (weights_only)
    gradients.rank<r>.safetensors   only when saved inside an accumulation window: each process's partial
                            gradient sums (not under FSDP2, which refuses such a save)
    <name>.json             extra_json={"name": ...} (the Trainer's trainer_state.json)

    manifest.json           written last: every other file's size and SHA-256 (mixprec.checkpoint.manifest)

Under FSDP2 with ``fsdp_state_dict_type="sharded"``, ``model_<i>.dcp/`` and ``optimizer_<i>.dcp/`` replace the
model and optimizer files: every process writes its own shards there (torch.distributed.checkpoint; see
:mod:`mixprec.strategies.dcp_state`), and ``accelerator.json`` says ``"sharded": true``.

The main process writes the shared parts, each process its RNG state, all into one temporary folder that
the main process renames into place once every process reported success (see
:mod:`mixprec.checkpoint.atomic`): a crash or an error at any point leaves the previous state as it was.
A folder shared by all processes (one machine, or a shared filesystem) is assumed.

Loading is all or nothing (issue 14, fault 4): every file is checked against the manifest and read into
host memory, and checked against the prepared objects (counts, parameter names and shapes, optimizer
groups), before any object is changed; a failure on any process raises on every process and leaves the
models, optimizers, schedulers, scaler, data positions and random generators as they were. The cost is
one read of every file for the checksums plus, briefly, a host copy of the whole state on every process
(under FSDP too, where only the main process's copy is used). A sharded state is checked against the
manifest the same way, but its names and shapes are checked by DCP as each model and optimizer loads (each
process reads only its pieces), so a mismatch found in a later object leaves the earlier ones loaded.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.atomic import abort, begin, recover, temp_path
from mixprec.checkpoint.background import BackgroundWriter
from mixprec.checkpoint.folder_checks import (
    FORMAT,
    META,
    Loaded,
    RunState,
    StateStrategy,
    counts,
    grads_name,
    name_of,
    read_everything,
)
from mixprec.checkpoint.manifest import BackgroundHasher, seal
from mixprec.checkpoint.model_part import completed, saved_part
from mixprec.checkpoint.rng import rng_snapshot, rng_state, set_rng_state
from mixprec.checkpoint.safe_files import CheckpointError, save_json, save_tensors, save_torch

logger = logging.getLogger("mixprec.accelerator")


def save_state(
    run: RunState,
    output_dir: str | Path,
    extra_json: Mapping[str, Any] | None = None,
    *,
    extra_torch: Mapping[str, Any] | None = None,
    safe_serialization: bool = True,
    pre_hook: Callable[[Path, list[Any]], None] | None = None,
    writer: BackgroundWriter | None = None,
    landed: Callable[[], object] | None = None,
) -> Path:
    """Write the folder atomically on every process; returns its path. Collective: call it on every process.

    ``safe_serialization``: model weights as safetensors (default) or torch.save files. ``pre_hook(tmp,
    model_states)``: called on the main process with the unfinished folder before anything is written, so
    the files it adds are part of the atomic folder and of its manifest (``register_save_state_pre_hook``).
    ``extra_torch``: small objects by file name, written with ``save_torch`` (weights_only-loadable) beside
    the JSON files, on the writer thread when asynchronous (no pre-hook, so no copy before returning).

    ``writer``: save asynchronously through it (:mod:`mixprec.checkpoint.background`). The main process then
    captures the model and optimizer tensors (:mod:`mixprec.checkpoint.staging`), the small states and the
    random generators (the stall: a walk of the state and the small copies, plus three tiny collectives), and
    the writer copies the tensors into reused host buffers (the next optimizer step waits for that copy:
    ``writer.fence``; a forward only reads them), then writes every file, the manifest and the commit while
    training goes on; the folder appears, complete, when that is done. What a forward rewrites (the models'
    buffers), tensors off the CPU, a strategy whose state tensors a forward may free (FSDP2) and a pre-hook (it
    sees the copy) make the copy happen before save_state returns. A lone process with no pre-hook and no
    partial gradients leaves even the unfinished folder's creation to the writer (an error there is raised by
    the next save or wait, like any write error). The previous asynchronous save is waited for first, and its
    failure raised on every process. Not with sharded (DCP) state. ``landed``: called by the writer once the
    folder is committed (the checkpoint manager's pruning); a synchronous save leaves it to the caller."""
    target, reg, strategy = Path(output_dir), run.registry, run.strategy
    main = strategy.is_main_process
    for key in extra_json or {}:
        if not key.isidentifier() or key in ("accelerator", "scaler"):
            raise ValueError(f"save_state(extra_json=...): {key!r} cannot name a file; use a plain identifier")
    for name in extra_torch or {}:
        if Path(name).name != name or name.startswith(".") or name.endswith(".json") or name.startswith("rng_state_"):
            raise ValueError(f"save_state(extra_torch=...): {name!r} is not a free file name; use a plain name")
    sharded = strategy.sharded_state  # each process writes its shards below (dcp_state.py); nothing gathered
    if writer is not None and sharded:
        raise ValueError(
            "save_state(async_save=True) with fsdp_state_dict_type='sharded' is not supported: each process's "
            "DCP shards are written synchronously; use async_save=False, or full state dicts"
        )
    previous = writer.wait() if writer is not None and main else None  # one save in flight at a time
    # Gather first (collectives under FSDP), write after: a process that fails to write then cannot leave the
    # others waiting in a collective.
    # a peft model's frozen base is not state: its adapters are (checkpoint/model_part.py)
    models = [] if sharded else [saved_part(m, strategy.model_state_dict(m)) for m in reg.models]
    optimizers = [] if sharded else [strategy.optimizer_state_dict(reg.owner(o), o.optimizer) for o in reg.optimizers]
    states = _const((models, optimizers))
    staged = None
    if writer is not None:  # the live tensors change at the next step: the writer gets a copy of them
        # (its previous job has finished); copied on the writer unless a hook must see the copy now
        defer = pre_hook is None and strategy.state_held_until_step
        now = _rewritten_by_forward(reg.models) if defer else set()
        staged = writer.staging.capture((models, optimizers), defer=defer, now=now)
        states = staged.states
        if pre_hook is not None:  # the hook sees (and may change) the very dicts the writer writes
            states = _const(states())
            models, optimizers = states()
    # inside an accumulation window the gradient sums are state too (the strategy refuses where it holds none)
    partial = strategy.partial_gradients(list(reg.models), run.gradients.micro_step, run.gradients.accumulation_steps)
    # nothing but the writer needs the unfinished folder: it creates it too (a mkdir and a scan, off the stall)
    deferred = writer is not None and strategy.num_processes == 1 and pre_hook is None and not partial
    tag = _save_tag(strategy)
    tmp = temp_path(target, tag)
    error: BaseException | None = previous
    if main and error is None and not deferred:
        try:
            tmp = begin(target, tag=tag)
        except Exception as err:
            error = err
    _agree(strategy, error, target, tmp if error is None else None)  # also: the folder exists for everyone
    # the synchronous save hashes its big files on a thread while writing the next; the writer thread hashes
    # them itself (an executor made or used after the interpreter began exiting refuses jobs, and the writer
    # may still run then: the thread is not a daemon, so a script's last save completes)
    hasher = BackgroundHasher() if main and writer is None else None
    try:
        strategy.save_shards(list(reg.models), _owned(run), tmp)  # FSDP2's sharded state; else nothing
        rng = rng_snapshot()  # the generators now; converted into tensors where the file is written
        rng_file = tmp / f"rng_state_{strategy.process_index}.pt"
        if main:
            if pre_hook is not None:
                pre_hook(tmp, models)
            small = _small_files(run, tmp, extra_json or {}, extra_torch or {})
            small.append(lambda: save_torch(rng(), rng_file))
            if writer is None:
                _write_big(tmp, models, optimizers, hasher, safe_serialization)
                for write in small:
                    write()
        else:  # before the main process seals the folder (the collective below)
            save_torch(rng(), rng_file)
        for i, grads in enumerate(partial):  # local (unsynced) sums: one file per process
            save_tensors(grads, tmp / grads_name(i, strategy.process_index))
    except Exception as err:  # reported to the other processes, then re-raised
        error = err
    try:
        _agree(strategy, error, target, tmp)
    except BaseException:
        if hasher is not None:
            hasher.close()
        raise
    if writer is not None:  # every process's files are in: the main one's writer finishes and seals the folder
        if main:
            made = tag if deferred else None
            # the copy first: until it is made, the next optimizer step waits (writer.fence)
            assert staged is not None
            take = _then(staged.copy, writer.release)
            job = functools.partial(_finish, tmp, target, made, take, states, small, safe_serialization, landed)
            writer.submit(job, reads_live=True)
        return target
    error = None
    if main:
        try:
            seal(tmp, target, hasher)  # once every process's files are in
        except Exception as err:
            error = err
    _agree(strategy, error, target, None)
    strategy.barrier()
    return target


def _finish(
    tmp: Path,
    target: Path,
    tag: str | None,
    take: Callable[[], None],
    states: Callable[[], tuple[list[Any], list[Any]]],
    small: list[Callable[[], Path]],
    safe: bool,
    landed: Callable[[], object] | None,
) -> None:
    """The writer's part of an asynchronous save: the host copy of the live tensors (``take``, which lets the
    training step go on), the unfinished folder if ``tag`` says it is not made yet, the main process's files,
    then the staged models and optimizers (``states()``), the manifest, the commit; then ``landed()``."""
    try:
        take()
        if tag is not None:
            begin(target, tag=tag)
        for write in small:
            write()
        _write_big(tmp, *states(), None, safe)
    except BaseException:
        abort(tmp)
        raise
    seal(tmp, target)
    if landed is not None:  # only now may older folders go (the pruning): this one is complete on disk
        landed()


def _save_tag(strategy: StateStrategy) -> str:
    """``<main pid>-<random>``: unique to this save, the same on every process (one tiny broadcast when
    there are several), and recognisable as stale once the main process is gone."""
    if strategy.num_processes == 1:  # nothing to agree on (a tensor and a broadcast: 0.1 ms of an async stall)
        return f"{os.getpid()}-{secrets.randbits(31):08x}"
    mine = torch.tensor([os.getpid(), secrets.randbits(31)], dtype=torch.int64, device=strategy.device)
    pid, token = (int(x) for x in strategy.broadcast(mine, src=0).tolist())
    return f"{pid}-{token:08x}"


def _agree(strategy: StateStrategy, error: BaseException | None, target: Path, tmp: Path | None) -> None:
    """Raise on every process if any process failed (the main one then throws the unfinished folder away)."""
    if strategy.all_true(error is None):
        return
    if strategy.is_main_process and tmp is not None:
        abort(tmp)
    raise error or CheckpointError(
        f"save_state({str(target)!r}): another process failed to write its part; the previous state is intact"
    )


def _write_big(
    tmp: Path, models: list[Any], optimizers: list[Any], hasher: BackgroundHasher | None, safe_serialization: bool
) -> None:
    # The big files are hashed in the background while the next ones are written (the small ones when the
    # manifest is written). The optimizer's (Adam: twice the model's size) goes first, so that its hashing
    # overlaps the model's writing. Measured on a 302 MB state (benchmarks/checkpoint_hash.py, shared 2-core
    # box): a save takes 1.0-1.4x as long as without the manifest (medians of 9 interleaved rounds).
    written = [save_torch(state, tmp / name_of("optimizer", i, "pt")) for i, state in enumerate(optimizers)]
    if hasher is not None:
        for path in written:
            hasher.add(path)
    for i, state in enumerate(models):
        if safe_serialization:
            path = save_tensors(state, tmp / name_of("model", i, "safetensors"))
        else:  # accelerate's name for the pickle format; read back with weights_only, so still no code runs
            path = save_torch(state, tmp / name_of("pytorch_model", i, "bin"))
        if hasher is not None:
            hasher.add(path)


def _small_files(
    run: RunState, tmp: Path, extra_json: Mapping[str, Any], extra_torch: Mapping[str, Any]
) -> list[Callable[[], Path]]:
    """Everything but the models and optimizers, captured now (copies of the live objects' states) as
    writers to call now (a synchronous save) or on the writer thread (an asynchronous one)."""
    reg = run.registry
    files: list[tuple[Callable[[Any, Path], Path], Any, str]] = [
        *((save_torch, s.state_dict(), name_of("scheduler", i, "pt")) for i, s in enumerate(reg.schedulers)),
        *((save_torch, obj.state_dict(), f"custom_{i}.pt") for i, obj in enumerate(reg.custom)),
        (save_json, run.precision.state_dict(), "scaler.json"),
        *((save_json, value, f"{key}.json") for key, value in extra_json.items()),
        *((save_torch, value, name) for name, value in extra_torch.items()),
        (save_json, _meta(run), META),
    ]
    return [functools.partial(write, copy.deepcopy(value), tmp / name) for write, value, name in files]


def _meta(run: RunState) -> dict[str, Any]:
    reg = run.registry
    return {
        "format": FORMAT,
        "mixed_precision": run.precision.name,
        "auto": run.precision.decision_record(),  # "auto"'s measurement: a resume keeps it, unmeasured
        "distributed": run.strategy.name,
        "sharded": run.strategy.sharded_state,  # models and optimizers as DCP shards (dcp_state.py)
        "num_processes": run.strategy.num_processes,
        "counts": counts(reg),
        "dataloaders": [loader.state_dict() for loader in reg.dataloaders],
        "gradients": run.gradients.state_dict(),
        "torch_version": torch.__version__,
    }


def load_state(run: RunState, input_dir: str | Path) -> dict[str, Any]:
    """Restore what :func:`save_state` wrote into the prepared objects; returns the metadata.
    Collective: call it on every process, after ``prepare``. All or nothing: raises (CheckpointError,
    naming the file) before changing anything if any file is missing, damaged or does not fit."""
    path, strategy = Path(input_dir), run.strategy
    if strategy.is_main_process:
        recover(path)  # finish a save that crashed between its two renames
    strategy.barrier()
    loaded: Loaded | None = None
    error: BaseException | None = None
    try:
        loaded = read_everything(run, path)
    except Exception as err:
        error = err
    if not strategy.all_true(error is None):
        raise error or CheckpointError(
            f"load_state({str(path)!r}): another process could not read its part; nothing was loaded"
        )
    assert loaded is not None
    _apply(run, loaded)
    strategy.barrier()
    return loaded.meta


def _apply(run: RunState, loaded: Loaded) -> None:
    """Load the checked state into the objects. The small ones (schedulers, scaler, custom objects, loaders,
    accumulation counter) are snapshotted first and put back if anything fails, which the checks above
    leave no known way to happen."""
    reg, strategy, meta = run.registry, run.strategy, loaded.meta
    # "auto" adopts the checkpoint's decision (no race); a named precision that differs says so on stderr
    run.precision.adopt_recorded(meta["mixed_precision"], meta.get("auto"))
    small: list[Any] = [*reg.schedulers, *reg.custom[: len(loaded.custom)], run.precision, run.gradients]
    small += [loader for loader, pos in zip(reg.dataloaders, meta["dataloaders"]) if pos is not None]
    snapshot = [(obj, copy.deepcopy(obj.state_dict())) for obj in small]
    generators = rng_state()
    try:
        if meta.get("sharded"):  # each process reads the pieces its part covers (any strategy, any count)
            strategy.load_shards(list(reg.models), _owned(run), loaded.path)
        for model, state in zip(reg.models, loaded.models):
            strategy.load_model_state_dict(model, _const(completed(strategy, model, state)))
        for optimizer, state in zip(reg.optimizers, loaded.optimizers):
            strategy.load_optimizer_state_dict(reg.owner(optimizer), optimizer.optimizer, _const(state))
        for scheduler, state in zip(reg.schedulers, loaded.schedulers):
            scheduler.load_state_dict(state)
        for obj, state in zip(reg.custom, loaded.custom):
            obj.load_state_dict(state)
        run.precision.load_state_dict(loaded.scaler)  # the scaler, or the non-finite guard and its record
        for loader, position in zip(reg.dataloaders, meta["dataloaders"]):
            if position is not None:
                loader.load_state_dict(position)
        run.gradients.load_state_dict(meta["gradients"])
        _restore_rng(loaded.rng, strategy, int(meta["num_processes"]))
    except Exception:
        for obj, state in snapshot:
            obj.load_state_dict(state)
        set_rng_state(generators)
        raise
    for model, grads in zip(reg.models, loaded.gradients):
        _restore_gradients(model, grads or {})


def _rewritten_by_forward(models: list[torch.nn.Module]) -> set[int]:
    """The addresses of the models' buffers (a BatchNorm's running statistics, a DDP's broadcast buffers): a
    forward writes them, so an asynchronous save copies them at the call. The parameters only change in steps."""
    return {b.data_ptr() for model in models for b in model.buffers() if b.numel()}


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def _owned(run: RunState) -> list[tuple[torch.nn.Module | None, Any]]:
    """Each prepared optimizer with the prepared model its parameters belong to (DCP needs both)."""
    return [(run.registry.owner(optimizer), optimizer.optimizer) for optimizer in run.registry.optimizers]


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


def _restore_gradients(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Gradient sums of an unfinished accumulation window, or none (a state saved at a step boundary)."""
    for name, p in model.named_parameters():
        p.grad = grads[name].to(device=p.device, dtype=p.dtype) if name in grads else None


def _restore_rng(state: dict[str, Any] | None, strategy: StateStrategy, saved_processes: int) -> None:
    if saved_processes != strategy.num_processes:
        logger.warning(
            "load_state: the state was saved by %d processes, now %d; random generators of process "
            "%d are restored only where it had a counterpart",
            saved_processes,
            strategy.num_processes,
            strategy.process_index,
        )
    if state is not None:
        set_rng_state(state)
