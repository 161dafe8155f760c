"""A ``save_state`` folder's names and parts, read and checked: what it must satisfy before ``load_state``
changes anything (issue 14, fault 4). The layout is described in :mod:`mixprec.checkpoint.folder_format`.

- :class:`Registry` / :class:`RunState`: the objects a folder holds the state of; the strategy, precision
  and accumulation counter are passed in and used through the small protocols below (checkpoint/ is the
  bottom floor: it imports nothing of the accelerator's, the strategies' or the precisions');
- :func:`read_everything`: every file read and checked into a :class:`Loaded`, nothing changed yet: the
  folder is intact (:func:`folder_problem`), and its state fits the prepared objects
  (:func:`check_model_fits`, :func:`check_optimizer_fits`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mixprec.checkpoint.manifest import NO_MANIFEST, verify_manifest
from mixprec.checkpoint.model_part import saved_keys
from mixprec.checkpoint.safe_files import CheckpointError, load_json, load_tensors, load_torch

META = "accelerator.json"
FORMAT = 1
MODEL_DIR = "model_{}.dcp"  # a sharded (DCP) state: one subfolder per model and per optimizer
OPTIMIZER_DIR = "optimizer_{}.dcp"
logger = logging.getLogger("mixprec.accelerator")


class StateStrategy(Protocol):
    """What the folder format asks of the distributed strategy (mixprec.strategies.strategy's interface)."""

    name: str
    is_main_process: bool
    process_index: int
    num_processes: int
    device: torch.device
    sharded_state: bool
    state_held_until_step: bool

    def barrier(self) -> None: ...
    def all_true(self, flag: bool) -> bool: ...
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...
    def model_state_dict(self, model: torch.nn.Module) -> Any: ...
    def optimizer_state_dict(self, model: Any, optimizer: Any) -> Any: ...
    def load_model_state_dict(self, model: torch.nn.Module, state: Any) -> Any: ...
    def load_optimizer_state_dict(self, model: Any, optimizer: Any, state: Any) -> Any: ...
    def partial_gradients(self, models: list[torch.nn.Module], micro_step: int, steps: int) -> Any: ...
    def save_shards(self, models: list[torch.nn.Module], optimizers: list[Any], folder: Path) -> Any: ...
    def load_shards(self, models: list[torch.nn.Module], optimizers: list[Any], folder: Path) -> Any: ...


class StatePrecision(Protocol):
    """What the folder format asks of the precision (its scaler's state, auto's recorded decision)."""

    name: str

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...
    def decision_record(self) -> Any: ...
    def adopt_recorded(self, name: str, record: Any) -> Any: ...


class AccumulationCounter(Protocol):
    """The accumulation window's place (a save inside a window keeps its partial gradients)."""

    micro_step: int
    accumulation_steps: int

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def folder_problem(path: Path, *, process_index: int = 0) -> str | None:
    """None if ``path`` is a complete, intact ``save_state`` folder: its manifest verifies, or, for a folder
    written before manifests, its metadata and this process's RNG file are there (accepted with a warning
    that its files cannot be checked). Else what is wrong, in a phrase naming the file. Reads every file."""
    if not path.is_dir():
        return "no such folder"
    problem = verify_manifest(path)
    if problem == NO_MANIFEST:
        if not (path / META).is_file():
            return f"no {META} and no manifest.json there, so it is not a folder written by save_state"
        if not (path / f"rng_state_{process_index}.pt").is_file():
            return f"rng_state_{process_index}.pt is missing (and there is no manifest.json)"
        logger.warning("%s has no manifest.json (written by an older mixprec): its files cannot be checked", path)
        return None
    return problem


def check_folder(path: Path, *, process_index: int = 0) -> None:
    """Raise unless :func:`folder_problem` finds nothing: FileNotFoundError for a folder that is not a
    ``save_state`` folder at all, CheckpointError (naming the file and what is wrong) for a damaged one."""
    problem = folder_problem(path, process_index=process_index)
    if problem is None:
        return
    if problem == "no such folder" or problem.startswith(f"no {META}"):
        raise FileNotFoundError(f"load_state({str(path)!r}): {problem}")
    raise CheckpointError(f"{path}: {problem}; the folder is damaged or incomplete, nothing was loaded from it")


def check_model_fits(
    model: torch.nn.Module, state: dict[str, torch.Tensor], file: Path, required: set[str] | None = None
) -> None:
    """``load_state_dict`` copies what matches before it complains about the rest: check names and shapes
    first, so a mismatch changes nothing. ``required``: the entries the state must hold (default: all of the
    model's; a peft model's checkpoint holds its trainable ones, see :mod:`mixprec.checkpoint.model_part`)."""
    mine = model.state_dict()
    missing = sorted((set(mine) if required is None else required) - set(state))
    unexpected = sorted(set(state) - set(mine))
    if missing or unexpected:
        what = f"lacks {missing[:3]}" if missing else f"has unknown entries {unexpected[:3]}"
        raise CheckpointError(f"{file} does not fit the prepared model: it {what}; prepare the same model as was saved")
    for name, tensor in mine.items():
        if name in state and tuple(tensor.shape) != tuple(state[name].shape):
            raise CheckpointError(
                f"{file} does not fit the prepared model: {name} is {tuple(state[name].shape)} there and "
                f"{tuple(tensor.shape)} here; prepare the same model as was saved"
            )


def check_optimizer_fits(optimizer: torch.optim.Optimizer, state: Any, file: Path) -> None:
    """What ``Optimizer.load_state_dict`` would refuse, checked before anything is loaded."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{file} is not an optimizer state (no param_groups/state)")
    sizes = [len(g.get("params", ())) for g in groups]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != mine:
        raise CheckpointError(
            f"{file} holds parameter groups of sizes {sizes}, the prepared optimizer {mine}; prepare the same "
            "optimizer as was saved"
        )


@dataclass
class Registry:
    """What ``prepare`` and ``register_for_checkpointing`` registered, in order."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    """The prepared optimizers (each holds the torch optimizer as ``.optimizer``)."""
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    """The prepared DataLoaders (``state_dict()``: their position; None for one whose order is not owned)."""
    custom: list[Any] = field(default_factory=list)

    def owner(self, optimizer: Any) -> torch.nn.Module | None:
        """The prepared model holding ``optimizer``'s first parameter."""
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        return next((m for m in self.models if any(p is first for p in m.parameters())), None)


@dataclass
class RunState:
    """The parts of an Accelerator that ``save_state`` / ``load_state`` touch."""

    registry: Registry
    strategy: StateStrategy
    precision: StatePrecision  # owns the scaler; under "auto", its decision is saved and kept at resume
    gradients: AccumulationCounter


def name_of(kind: str, index: int, ext: str) -> str:
    """A file's name in the folder: ``model.safetensors``, then ``model_1.safetensors``... per object."""
    return f"{kind}.{ext}" if index == 0 else f"{kind}_{index}.{ext}"


def grads_name(model_index: int, rank: int) -> str:
    return f"{name_of('gradients', model_index, 'rank')}{rank}.safetensors"


def counts(reg: Registry) -> dict[str, int]:
    return {
        "models": len(reg.models),
        "optimizers": len(reg.optimizers),
        "schedulers": len(reg.schedulers),
        "dataloaders": len(reg.dataloaders),
        "custom": len(reg.custom),
    }


@dataclass
class Loaded:
    """Everything a folder holds, read, parsed and checked; applying it cannot fail on a damaged file."""

    path: Path
    meta: dict[str, Any]
    models: list[dict[str, torch.Tensor]]
    optimizers: list[Any]
    schedulers: list[Any]
    custom: list[Any]
    scaler: dict[str, Any]
    gradients: list[dict[str, torch.Tensor] | None]
    rng: dict[str, Any] | None


def read_everything(run: RunState, path: Path) -> Loaded:
    reg, strategy = run.registry, run.strategy
    check_folder(path, process_index=strategy.process_index)
    meta = load_json(path / META)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path / META}: format {found!r}, this mixprec reads {FORMAT}")
    saved, now = meta["counts"], counts(reg)
    for kind in ("models", "optimizers", "schedulers"):
        if saved[kind] != now[kind]:
            raise ValueError(
                f"load_state({str(path)!r}): the state holds {saved[kind]} {kind}, this Accelerator prepared "
                f"{now[kind]}; prepare the same objects (in the same order) before load_state"
            )
    if meta.get("sharded"):  # read when applied, each process its pieces (DCP checks names and shapes)
        missing = missing_sharded_parts(path, len(reg.models), len(reg.optimizers))
        if missing:
            raise CheckpointError(f"{path}: the sharded state lacks {', '.join(missing)}; nothing was loaded")
        models, optimizers = [], []
    else:
        models = [load_model_file(path, i) for i in range(len(reg.models))]
        for i, (model, state) in enumerate(zip(reg.models, models)):
            check_model_fits(model, state, path / name_of("model", i, "safetensors"), saved_keys(model))
        optimizers = [load_torch(path / name_of("optimizer", i, "pt")) for i in range(len(reg.optimizers))]
        for i, (optimizer, state) in enumerate(zip(reg.optimizers, optimizers)):
            check_optimizer_fits(optimizer.optimizer, state, path / name_of("optimizer", i, "pt"))
    schedulers = [load_torch(path / name_of("scheduler", i, "pt")) for i in range(len(reg.schedulers))]
    custom = [load_torch(path / f"custom_{i}.pt") for i in range(min(len(reg.custom), saved.get("custom", 0)))]
    scaler = load_json(path / "scaler.json")
    grads = []
    for i in range(len(reg.models)):
        file = path / grads_name(i, strategy.process_index)
        grads.append(load_tensors(file) if file.is_file() else None)
    rng_file = path / f"rng_state_{strategy.process_index}.pt"
    rng = load_torch(rng_file) if rng_file.is_file() else None
    if rng is None and int(meta["num_processes"]) > strategy.process_index:
        raise CheckpointError(f"{rng_file} is missing: the random generators could not be restored exactly")
    return Loaded(path, meta, models, optimizers, schedulers, custom, scaler, grads, rng)


def load_model_file(path: Path, index: int) -> dict[str, torch.Tensor]:
    """The model's weights from either format ``save_state(safe_serialization=...)`` writes."""
    pickled = path / name_of("pytorch_model", index, "bin")
    if pickled.is_file() and not (path / name_of("model", index, "safetensors")).is_file():
        return load_torch(pickled)
    return load_tensors(path / name_of("model", index, "safetensors"))


def missing_sharded_parts(folder: Path, models: int, optimizers: int) -> list[str]:
    """The DCP subfolders a sharded save of that many objects should hold but ``folder`` lacks."""
    names = [MODEL_DIR.format(i) for i in range(models)] + [OPTIMIZER_DIR.format(i) for i in range(optimizers)]
    return [n for n in names if not (folder / n / ".metadata").is_file()]
