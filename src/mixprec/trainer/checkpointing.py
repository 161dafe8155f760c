"""The Trainer's side of its ``checkpoint-<step>`` folders: the Trainer's own JSON files in them, and when it
saves, resumes and locks.

A checkpoint is one ``Accelerator.save_state`` folder (its format, numbering, listing, resume lookup and
keep-k pruning are the checkpoint manager's: :mod:`mixprec.checkpoint.manager`, with the Trainer's naming
:func:`~mixprec.checkpoint.folders.trainer_folders`), and the Trainer's JSON files are written into the same
atomic folder (``extra_json``)::

    trainer_state.json      TrainerState (HF's file name and fields)
    trainer_extra.json      the trainer's data position and running-loss window (an exact resume)
    training_args.json      the arguments of the run (for people; only its length is read back, by a resume
                            with another number of processes: world_change.py)
    training_args.bin       } HF's names, for HF's scripts and tools (mixprec.trainer.hf_files): the same
    rng_state.pth           } arguments and generators, weights_only-loadable; never read back by mixprec
    adapter_config.json     } a peft model's, by peft's save_pretrained (mixprec.trainer.weights.adapter_files),
    adapter_model.safetensors } as HF's checkpoints: PeftModel.from_pretrained loads them; never read back

Resuming, from the Trainer (``resume_from_checkpoint=True``) or from the command line (``--resume``), goes
through one listing, ``trainer_folders(output_dir).find_resumable()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.checkpoint import CheckpointError, DiskFullError, FolderLock, load_json, lock_folder
from mixprec.checkpoint.folders import TRAINER_ARGS, TRAINER_EXTRA, TRAINER_STATE, trainer_folders
from mixprec.checkpoint.manager import Keep
from mixprec.loaders.from_datasets import DataPosition
from mixprec.strategies.restarts import agree_on_number, restarted_anywhere
from mixprec.trainer import world_change
from mixprec.trainer.hf_files import hf_files
from mixprec.trainer.hf_loggers import hf_logger
from mixprec.trainer.state import TrainerState
from mixprec.trainer.weights import adapter_files, model_config_file

if TYPE_CHECKING:
    from mixprec.trainer.context import RunContext

logger = logging.getLogger("mixprec.trainer")


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The run's newest complete checkpoint (for messages that say where to resume from)."""
    return trainer_folders(output_dir).latest()


def agree_on_resume(
    accelerator: Any, resume_from_checkpoint: bool | str | os.PathLike[str] | None, output_dir: str
) -> Path | None:
    """The checkpoint every process resumes from, chosen once by the main process and sent to the others
    (one tiny all-reduce), so processes never disagree because one of them saw a save land a moment later,
    or a folder the others cannot read. Collective.

    ``resume_from_checkpoint=None`` in a worker group that torchelastic restarted (on any node: see
    :mod:`mixprec.strategies.restarts`) means the newest complete checkpoint if there is one, else a fresh
    start: the automatic resume of ``torchrun --max-restarts=N``. Pass ``False`` to always start fresh."""
    elastic = resume_from_checkpoint is None and restarted_anywhere(accelerator)
    code, error = -1, None  # -1: start fresh; -2: the main process failed; N >= 0: checkpoint-N (or the path)
    folders = trainer_folders(output_dir)
    if accelerator.is_main_process:
        try:
            folders.recover()
            if elastic:
                found = folders.find_resumable(recover_first=False).checkpoint
                logger.warning(
                    "restarted by the launcher: %s",
                    f"resuming from {found}" if found else f"no complete checkpoint in {output_dir}; starting afresh",
                )
            else:
                found = folders.resolve_resume(resume_from_checkpoint, recover_first=True)
            number = None if found is None else folders.number_of(found)
            code = -1 if found is None else (number if number is not None else 0)
            chosen = found
        except Exception as err:
            code, error = -2, err
    code = agree_on_number(accelerator, code)
    if error is not None:
        raise error
    if code == -2:
        raise CheckpointError(
            f"the main process could not choose a checkpoint to resume from in {output_dir} (see its error)"
        )
    if accelerator.is_main_process:
        return chosen
    if code == -1:
        return None
    if resume_from_checkpoint is not None and resume_from_checkpoint is not True and not elastic:
        return Path(resume_from_checkpoint)
    return folders.folder(code)


# -- the Trainer's side ----------------------------------------------------------------------------------


def lock_output_dir(accelerator: Any, output_dir: str) -> FolderLock | contextlib.nullcontext[None]:
    """Lock ``output_dir`` for this run (main process; re-entrant, so a command line that locked it first
    is fine). Collective: when the main process is refused, every process raises the same
    :class:`~mixprec.checkpoint.FolderInUseError`-like error, so none waits forever in a collective. One tiny
    all-reduce when there are several processes."""
    error: BaseException | None = None
    held = None
    if accelerator.is_main_process:
        try:
            held = lock_folder(output_dir, what="output_dir")
        except Exception as err:
            error = err
    if accelerator.num_processes > 1:
        failed = bool(accelerator.reduce(torch.tensor(int(error is not None)), reduction="max").item())
        if failed and error is None:
            raise CheckpointError(f"output_dir {output_dir} could not be locked by the main process (see its error)")
    if error is not None:
        raise error
    return held if held is not None else contextlib.nullcontext()


def save_trainer_checkpoint(run: RunContext, position: DataPosition) -> Path:
    """checkpoint-<global_step> with the trainer's state, then ``on_save``. Collective. The checkpoint manager
    prunes to ``save_total_limit`` (never the best checkpoint) on its writer thread, once the folder has
    landed (with ``async_save`` too)."""
    args, state, acc = run.args, run.state, run.accelerator
    model = acc.unwrap_model(run.model)
    folders = trainer_folders(args.output_dir)
    path = folders.folder(state.global_step)
    best = folders.folder(state.best_global_step) if state.best_global_step else None
    # HF's rule: each save points at the best step's checkpoint if it exists, this one included; an evaluation
    # after that step's save (eval per epoch, save per step) is then recorded at the next save
    if best is not None and (state.best_global_step == state.global_step or folders.is_complete(best)):
        state.best_model_checkpoint = str(best)
    files = {
        TRAINER_STATE: state.to_dict(),
        TRAINER_EXTRA: {"data_position": position.to_dict(), "meter": run.meter.state_dict(), "sized_by": run.sized_by},
        TRAINER_ARGS: args.to_dict(),
        **model_config_file(model),  # none for a peft model: its adapter files instead
    }
    keep = Keep(folders, args.save_total_limit, protect=state.best_model_checkpoint)
    # HF's training_args.bin / rng_state.pth (hf_files.py) from the main process, in the folder and its manifest
    hf = hf_files(args, acc.num_processes) if acc.is_main_process else None
    with _disk_full_explained(run, None if args.async_save else path.name):  # async: maybe the previous one
        peft_files = adapter_files(model)
        acc.checkpoints.save(
            path, extra_json=files, extra_torch=hf, async_save=args.async_save, keep=keep, pre_hook=peft_files
        )
    run.events.fire("on_save", checkpoint=str(path))
    return path


def wait_for_checkpoint(run: RunContext, ended: bool = False) -> None:
    """Collective: an asynchronous checkpoint still being written lands, and the pruning after it is done (its
    failure raised, a full disk explained as for a synchronous save). A run that ``ended`` with
    ``save_total_limit=1`` keeps its best checkpoint alone, as HF's (the newest stayed beside it for a resume)."""
    with _disk_full_explained(run, None):
        run.accelerator.wait_for_checkpoint()
    best, args = run.state.best_model_checkpoint, run.args
    if ended and best is not None and args.save_total_limit == 1 and run.accelerator.is_main_process:
        trainer_folders(args.output_dir).prune(1, protect=best, ended=True)


@contextlib.contextmanager
def _disk_full_explained(run: RunContext, name: str | None) -> Any:
    """A full disk during a save as one sentence: which checkpoint failed (``name``, or for an asynchronous
    save the one whose unfinished folder held the file), that the previous one is intact, how to resume."""
    try:
        yield
    except DiskFullError as err:
        output_dir = run.args.output_dir
        unfinished = trainer_folders(output_dir).unfinished_holding(err.filename)
        failed = name or (unfinished.name if unfinished is not None else "a checkpoint")
        last = latest_checkpoint(output_dir)
        intact = f"the previous checkpoint, {last}, is intact" if last else "no earlier checkpoint exists"
        raise DiskFullError(
            err.errno,
            f"disk full: {failed} could not be saved (no space left while writing "
            f"{Path(err.filename or '?').name}); {intact}. Free space on {output_dir}, then resume with "
            f"{run.resume_command}",
            err.filename,
        ) from None


def load_trainer_checkpoint(run: RunContext, path: Path, max_steps: int | None = None) -> DataPosition:
    """Restore model, optimizer, scheduler, scaler, data position and RNG states (the Accelerator's
    load_state), then the trainer's state (in place), loss window and log; return where the data stands.
    Nothing is unpickled: a tampered file raises (UnsafeCheckpointError) before training starts. The
    trainer's own files are read and parsed first, so a damaged one fails before the Accelerator loads
    anything. Saved by another number of processes: the data position is mapped to this one's split, and one
    line says what the run keeps (its steps, ``max_steps`` of them) and what it cannot (world_change.py)."""
    saved, extra = load_json(path / f"{TRAINER_STATE}.json"), load_json(path / f"{TRAINER_EXTRA}.json")
    _warn_changed_args(run.args, saved)
    loaded = TrainerState(**{k: v for k, v in saved.items() if k in TrainerState.__dataclass_fields__})
    position = DataPosition.from_dict(extra["data_position"])
    acc = run.accelerator
    saved_processes = int(acc.load_state(path).get("num_processes", acc.num_processes))
    if saved_processes != acc.num_processes:
        moved = world_change.rescaled(position, run.train_loader, saved_processes, acc.num_processes)
        if acc.is_main_process:
            steps = (loaded.global_step, max_steps if max_steps is not None else loaded.max_steps)
            said = world_change.explain(path, (saved_processes, position), (acc.num_processes, moved), steps)
            logger.warning("%s", said)
        position = moved
    state = run.state
    for name in TrainerState.__dataclass_fields__:  # which process this is stays as it was
        if name not in ("is_local_process_zero", "is_world_process_zero"):
            setattr(state, name, getattr(loaded, name))
    run.meter.load_state_dict(extra.get("meter", {}), run.accelerator.device)
    run.events.forget_records_after(state.global_step)
    logger.info("resumed from %s at step %d", path, state.global_step)
    _check_loader_agrees(run.train_loader, position, path)
    return position


def resume_run(
    run: RunContext, checkpoint: Path, train_stream: Any = None, max_steps: int | None = None
) -> DataPosition:
    """The run as ``checkpoint`` left it (:func:`load_trainer_checkpoint`; ``max_steps``: the run's, for its
    message), its callbacks' states restored and the resume recorded. A stream (``train_stream``) cannot seek:
    its pass, reshuffled as it was, reads past what was trained."""
    start = load_trainer_checkpoint(run, checkpoint, max_steps)
    if train_stream is not None:
        train_stream.skip_batches(start.batches_consumed)
        run.train_loader.set_epoch(start.epoch)
    run.events.restore_callback_states()
    step = run.state.global_step
    run.events.record("train_begin", step, resumed_from=step, precision=run.accelerator.mixed_precision)
    return start


def _check_loader_agrees(loader: Any, position: DataPosition, path: Path) -> None:
    """The trainer's data position and the prepared loader's must name the same next batch; if a change in
    either ever made them drift, an exact resume would silently become an inexact one."""
    state = loader.state_dict() if hasattr(loader, "state_dict") else None
    if state is None:  # a loader whose order the Accelerator does not own
        return
    mine = (position.epoch, position.batches_consumed)
    if position.batches_consumed > len(loader):  # more than an epoch holds now: not the data it was saved with
        raise CheckpointError(
            f"{path}: it was saved {position.batches_consumed} batches into epoch {position.epoch}, and an epoch "
            f"now holds {len(loader)}: the training data changed since (another dataset, its size or the batch "
            "size); resume with the data the run was saved with, or start a new run"
        )
    if position.batches_consumed == len(loader):  # the epoch's last batch was read: the next is epoch + 1
        mine = (position.epoch + 1, 0)
    if mine != (int(state["epoch"]), int(state["batches"])):
        raise CheckpointError(
            f"{path}: the trainer's data position (epoch {position.epoch}, {position.batches_consumed} batches) "
            f"and the data loader's (epoch {state['epoch']}, {state['batches']} batches) disagree; the "
            "checkpoint was written by an incompatible version"
        )


def _warn_changed_args(args: Any, saved: dict[str, Any]) -> None:
    """HF's warning (its words, on its logger: scripts and HF's tests read them) when a resume's logging, eval
    or save interval or per-device batch size differs from the checkpoint's: the run goes on with the new
    values, which a user changing them by mistake should hear."""
    pairs = [(k, getattr(args, k, None), saved.get(k)) for k in ("logging_steps", "eval_steps", "save_steps")]
    pairs.append(("per_device_train_batch_size", args.per_device_train_batch_size, saved.get("train_batch_size")))
    changed = [
        f"\n\t{k}: {new} (from args) != {old} (from trainer_state.json)"
        for k, new, old in pairs
        if new is not None and old is not None and new != old
    ]
    if changed:
        hf_logger("trainer").warning(
            "Warning: The following arguments do not match the ones in the `trainer_state.json` within the "
            "checkpoint directory: %s",
            "".join(changed),
        )
