"""checkpoint-N folders: written whole or not at all, read back without unpickling, pruned safely.

A checkpoint is one ``Accelerator.save_state`` folder, ``<output_dir>/checkpoint-<step>/``, with the
trainer's JSON files written into the same atomic folder (``extra_json``)::

    model.safetensors       the model (safetensors: no code can run on load)
    optimizer.pt            optimizer state      } torch.load(weights_only=True): tensors and plain
    scheduler.pt            LR scheduler state   } containers only; anything else is refused
    rng_state_<rank>.pt     python/numpy/torch/CUDA generators of each process
    scaler.json             loss scaler state and its step record
    accelerator.json        data positions (epoch, batches handed out), accumulation counter
    trainer_state.json      TrainerState (HF's file name and fields)
    trainer_extra.json      the trainer's data position and running-loss window (an exact resume)
    training_args.json      the arguments of the run (for people; never read back into the run)
    training_args.bin       } HF's names, for HF's scripts and tools (mixprec.trainer.hf_files): the same
    rng_state.pth           } arguments and generators, weights_only-loadable; never read back by mixprec

The folder is staged as ``.checkpoint-<step>.tmp-*`` and renamed into place (see
:mod:`mixprec.checkpoint.atomic`), so a kill at any instant leaves the previous checkpoints as they were and
no ``checkpoint-*`` folder that is half written. Old checkpoints are pruned only after the new one is
committed, and each is first renamed out of the ``checkpoint-*`` namespace, so a kill during the deletion
cannot leave a damaged folder that looks like a checkpoint.

Each folder ends with ``manifest.json`` (every file's size and SHA-256, written last). Resuming, from the
Trainer (``resume_from_checkpoint=True``) or from the command line (``--resume``), goes through one function,
:func:`find_resumable`: it first finishes any commit a crash interrupted, then takes the newest checkpoint
whose manifest verifies, saying in one line (a warning) which newer ones it skipped and why. A checkpoint
written before manifests existed is accepted, with a warning, when its required files are all there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.accelerator.state_checks import folder_problem
from mixprec.checkpoint import CheckpointError, DiskFullError, FolderLock, load_json, lock_folder, recover
from mixprec.checkpoint.folders import NumberedFolders
from mixprec.strategies.restarts import agree_on_number, restarted_anywhere
from mixprec.trainer.data import DataPosition
from mixprec.trainer.hf_files import write_hf_files
from mixprec.trainer.hf_loggers import hf_logger
from mixprec.trainer.state import TrainerState
from mixprec.trainer.weights import model_config_file

if TYPE_CHECKING:
    from mixprec.trainer.context import RunContext

logger = logging.getLogger("mixprec.trainer")

PREFIX = "checkpoint-"
STATE_NAME = "trainer_state"
EXTRA_NAME = "trainer_extra"
ARGS_NAME = "training_args"
REQUIRED = ("accelerator.json", f"{STATE_NAME}.json", f"{EXTRA_NAME}.json")


def folders(output_dir: str | os.PathLike[str]) -> NumberedFolders:
    """The run's ``checkpoint-<step>`` folders (listing, latest, recovery, pruning: one owner for both namings)."""
    return NumberedFolders(output_dir, PREFIX, required=REQUIRED, legacy=(*REQUIRED, "rng_state_0.pt"))


def step_of(path: Path) -> int | None:
    return folders(Path(path).parent).number_of(path)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """A folder that looks like a whole checkpoint, by a cheap check (no file is read): every file its
    manifest lists is there with the listed size, and the trainer's files are among them; for a folder
    written before manifests, the files every checkpoint has are there. :func:`verify_checkpoint` reads
    every byte."""
    return folders(Path(path).parent).is_complete(path)


def verify_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """None if ``path`` is a checkpoint that can be resumed from (its manifest verifies and it holds the
    trainer's files; or, written before manifests, all its files are there), else why not, in a phrase.
    Reads every file once."""
    path = Path(path)
    problem = folder_problem(path)
    if problem is not None:
        return problem
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        return f"{missing[0]} is missing (it is not a checkpoint the Trainer wrote)"
    return None


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint-N folders of ``output_dir`` (by :func:`is_complete`'s cheap check), oldest first."""
    return folders(output_dir).complete()


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    return folders(output_dir).latest()


@dataclass
class Resumable:
    """What :func:`find_resumable` found: the checkpoint to resume from (None: none passes) and the newer
    ones it skipped, each with the reason."""

    checkpoint: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def describe_skipped(self) -> str:
        """One line: "skipped checkpoint-8 (model.safetensors does not match ...); resuming from checkpoint-4"."""
        parts = "; ".join(f"{p.name}: {why}" for p, why in self.skipped)
        then = f"resuming from {self.checkpoint.name}" if self.checkpoint else "no checkpoint is left to resume from"
        return f"skipped damaged or incomplete checkpoints ({parts}); {then}"


def find_resumable(output_dir: str | os.PathLike[str], *, recover_first: bool = True) -> Resumable:
    """THE listing for a resume (the Trainer's and the command line's): finish interrupted commits (pass
    ``recover_first=False`` on processes other than the main one, which does it), then the newest
    checkpoint-N of ``output_dir`` that :func:`verify_checkpoint` passes. Logs a warning naming each newer
    one skipped and why. Reads every file of the checkpoints it checks."""
    root = Path(output_dir)
    if recover_first:
        folders(root).recover()
    candidates = folders(root).numbered()  # complete or not: verify_checkpoint says why one is skipped
    result = Resumable(None)
    for path in reversed(candidates):
        problem = verify_checkpoint(path)
        if problem is None:
            result.checkpoint = path
            break
        result.skipped.append((path, problem))
    if result.skipped:
        logger.warning("%s", result.describe_skipped())
    return result


def resolve_resume(
    resume_from_checkpoint: bool | str | os.PathLike[str] | None, output_dir: str, *, recover_first: bool = True
) -> Path | None:
    """``None``/``False``: start fresh. ``True``: :func:`find_resumable`'s checkpoint (ValueError if none
    passes). A path: that checkpoint, which must look complete (CheckpointError saying which file is wrong;
    ``load_state`` then verifies every byte)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        found = find_resumable(output_dir, recover_first=recover_first)
        if found.checkpoint is None:
            why = f" ({found.describe_skipped()})" if found.skipped else ""
            raise ValueError(
                f"No valid checkpoint found in output directory ({output_dir}): train(resume_from_checkpoint=True) "
                f"found no complete checkpoint-N folder{why}; train without resume_from_checkpoint to start fresh"
            )
        return found.checkpoint
    path = Path(resume_from_checkpoint)
    if recover_first:
        recover(path)
    if not path.is_dir():
        # HF's wording first ("Can't find a valid checkpoint at"): scripts and HF's tests match it
        raise ValueError(f"Can't find a valid checkpoint at {path}: no such folder (train(resume_from_checkpoint=...))")
    # the cheap check here (sizes); load_state reads and verifies every byte (no third read of the folder)
    problem = None if is_complete(path) else (verify_checkpoint(path) or "it lacks the trainer's files")
    if problem is not None:
        raise CheckpointError(
            f"Can't find a valid checkpoint at {path}: the folder is not a complete checkpoint ({problem}); "
            "use train(resume_from_checkpoint=True) for the newest one that is"
        )
    return path


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
    if accelerator.is_main_process:
        try:
            folders(output_dir).recover()
            if elastic:
                found = find_resumable(output_dir, recover_first=False).checkpoint
                logger.warning(
                    "restarted by the launcher: %s",
                    f"resuming from {found}" if found else f"no complete checkpoint in {output_dir}; starting afresh",
                )
            else:
                found = resolve_resume(resume_from_checkpoint, output_dir, recover_first=True)
            code = -1 if found is None else (step_of(found) if step_of(found) is not None else 0)
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
    return Path(output_dir) / f"{PREFIX}{code}"


def save_checkpoint(
    output_dir: str | os.PathLike[str], step: int, accelerator: Any, files: dict[str, Any], async_save: bool = False
) -> Path:
    """Write checkpoint-``step`` atomically with the trainer's JSON ``files`` ({name: object}) inside.
    Collective: every process calls it (each saves its RNG state; sharded models gather). ``async_save``: the
    folder is written and committed by a background thread (it appears once complete)."""
    return accelerator.save_state(Path(output_dir) / f"{PREFIX}{step}", extra_json=files, async_save=async_save)


def prune_checkpoints(output_dir: str | os.PathLike[str], limit: int | None, keep: str | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``, never ``keep`` (the best one, as HF does).
    Call only after the newest checkpoint is committed. Returns what was deleted."""
    found = folders(output_dir)
    if limit == 1 and keep is not None:  # HF's rule: with limit 1 and a best checkpoint that is not the last, keep both
        last = found.latest()
        limit = 2 if last is not None and last.resolve() != Path(keep).resolve() else 1
    return found.prune(limit, protect=keep)


def read_trainer_files(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainer's state and extra of a checkpoint (JSON only: nothing here can run code)."""
    path = Path(path)
    return load_json(path / f"{STATE_NAME}.json"), load_json(path / f"{EXTRA_NAME}.json")


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
    """checkpoint-<global_step> with the trainer's state; then prune, then ``on_save``. Collective."""
    args, state, acc = run.args, run.state, run.accelerator
    path = Path(args.output_dir) / f"{PREFIX}{state.global_step}"
    best = Path(args.output_dir) / f"{PREFIX}{state.best_global_step}"
    # HF's rule: each save points at the best step's checkpoint if it exists, this one included; an evaluation
    # after that step's save (eval per epoch, save per step) is then recorded at the next save
    if state.best_global_step and (state.best_global_step == state.global_step or is_complete(best)):
        state.best_model_checkpoint = str(best)
    files = {
        STATE_NAME: state.to_dict(),
        EXTRA_NAME: {"data_position": position.to_dict(), "meter": run.meter.state_dict()},
        ARGS_NAME: args.to_dict(),
        **model_config_file(acc.unwrap_model(run.model)),
    }
    # HF's training_args.bin / rng_state.pth, written into the unfinished folder (in the manifest) by a
    # save_state pre-hook on the main process (hf_files.py). Cost: an async save copies the tensors before
    # returning when a pre-hook is registered (accelerator/state.py), so its stall includes that copy.
    hf_hook = acc.register_save_state_pre_hook(
        lambda _models, _weights, folder: write_hf_files(folder, args, acc.num_processes)
    )
    try:
        with _disk_full_explained(run, None if args.async_save else path.name):  # async: maybe the previous one
            save_checkpoint(args.output_dir, state.global_step, acc, files, async_save=args.async_save)
    finally:
        hf_hook.remove()
    if acc.is_main_process:  # only now that the new one is complete (async_save: it still lands, so one extra)
        prune_checkpoints(args.output_dir, args.save_total_limit, keep=state.best_model_checkpoint)
    acc.wait_for_everyone()
    run.events.fire("on_save", checkpoint=str(path))
    return path


def wait_for_checkpoint(run: RunContext) -> None:
    """Collective: an asynchronous checkpoint still being written lands (its failure raised, a full disk
    explained as for a synchronous save); then the pruning its save could not do yet (save_total_limit)."""
    with _disk_full_explained(run, None):
        run.accelerator.wait_for_checkpoint()
    if run.args.async_save and run.accelerator.is_main_process:
        prune_checkpoints(run.args.output_dir, run.args.save_total_limit, keep=run.state.best_model_checkpoint)


@contextlib.contextmanager
def _disk_full_explained(run: RunContext, name: str | None) -> Any:
    """A full disk during a save as one sentence: which checkpoint failed (``name``, or for an asynchronous
    save the one whose unfinished folder held the file), that the previous one is intact, how to resume."""
    try:
        yield
    except DiskFullError as err:
        output_dir = run.args.output_dir
        failed = name or _checkpoint_of(err.filename) or "a checkpoint"
        last = latest_checkpoint(output_dir)
        intact = f"the previous checkpoint, {last}, is intact" if last else "no earlier checkpoint exists"
        raise DiskFullError(
            err.errno,
            f"disk full: {failed} could not be saved (no space left while writing "
            f"{Path(err.filename or '?').name}); {intact}. Free space on {output_dir}, then resume with "
            f"{run.resume_command}",
            err.filename,
        ) from None


def _checkpoint_of(filename: str | None) -> str | None:
    """``checkpoint-N`` from a file inside its unfinished folder (``.checkpoint-N.tmp-<tag>/...``)."""
    match = re.search(rf"\.({PREFIX}\d+)\.tmp-", filename or "")
    return match.group(1) if match else None


def load_trainer_checkpoint(run: RunContext, path: Path) -> DataPosition:
    """Restore model, optimizer, scheduler, scaler, data position and RNG states (the Accelerator's
    load_state), then the trainer's state (in place), loss window and log; return where the data stands.
    Nothing is unpickled: a tampered file raises (UnsafeCheckpointError) before training starts. The
    trainer's own files are read and parsed first, so a damaged one fails before the Accelerator loads
    anything."""
    saved, extra = read_trainer_files(path)
    _warn_changed_args(run.args, saved)
    loaded = TrainerState(**{k: v for k, v in saved.items() if k in TrainerState.__dataclass_fields__})
    position = DataPosition.from_dict(extra["data_position"])
    run.accelerator.load_state(path)
    state = run.state
    for name in TrainerState.__dataclass_fields__:  # which process this is stays as it was
        if name not in ("is_local_process_zero", "is_world_process_zero"):
            setattr(state, name, getattr(loaded, name))
    run.meter.load_state_dict(extra.get("meter", {}), run.accelerator.device)
    run.events.forget_records_after(state.global_step)
    logger.info("resumed from %s at step %d", path, state.global_step)
    _check_loader_agrees(run.train_loader, position, path)
    return position


def _check_loader_agrees(loader: Any, position: DataPosition, path: Path) -> None:
    """The trainer's data position and the prepared loader's must name the same next batch; if a change in
    either ever made them drift, an exact resume would silently become an inexact one."""
    state = loader.state_dict() if hasattr(loader, "state_dict") else None
    if state is None:  # a loader whose order the Accelerator does not own
        return
    mine = (position.epoch, position.batches_consumed)
    if position.batches_consumed >= len(loader):  # the epoch's last batch was read: the next is epoch + 1
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
    changed = [f"\n\t{k}: {new} (from args) != {old} (from trainer_state.json)"
               for k, new, old in pairs if new is not None and old is not None and new != old]  # fmt: skip
    if changed:
        hf_logger("trainer").warning(
            "Warning: The following arguments do not match the ones in the `trainer_state.json` within the "
            "checkpoint directory: %s", "".join(changed)
        )
