"""Safe file formats: nothing read back here can run code.

- tensors: safetensors (a JSON header and raw bytes), with tied weights stored once and restored as aliases;
- plain state (counters, configs, the scaler): JSON;
- optimizer, scheduler and RNG state (nested dicts of tensors and numbers): ``torch.save``, read back with
  ``torch.load(weights_only=True)``, whose unpickler only builds tensors and plain containers. A file that
  needs anything else (a class, a function: what a booby-trapped pickle uses) is refused with
  :class:`UnsafeCheckpointError`, and :func:`save_torch` refuses to write what could not be read back.

Every writer writes to a temporary file, fsyncs it and renames it into place, so a file is never half there.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.atomic import write_atomically

_ALIASES_KEY = "mixprec.aliases"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing a part, malformed, or was written by something else."""


class UnsafeCheckpointError(CheckpointError):
    """A file would need arbitrary unpickling (running code) to load; it was not loaded."""


# -- tensors -------------------------------------------------------------------------------------------


def save_tensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a flat ``{name: tensor}`` dict (a ``state_dict``) as safetensors.

    Entries that are the same view of the same storage (tied weights, e.g. an embedding shared with the
    output layer) are stored once and restored as the same tensor; safetensors itself refuses shared memory.
    Copies to the host: one device sync per tensor on an accelerator.
    """
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_of_view: dict[tuple[Any, ...], str] = {}
    owners: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"save_tensors: {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach()
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
            raise TypeError(
                f"save_tensors: {name!r} is a {type(tensor).__name__}; gather it into a plain tensor first "
                "(e.g. DTensor.full_tensor())"
            )
        if tensor.numel() > 0:
            ptr = tensor.untyped_storage().data_ptr()
            view = (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if view in first_of_view:
                aliases[name] = first_of_view[view]
                continue
            first_of_view[view] = name
            owners.setdefault(ptr, []).append(name)
        out[name] = tensor
    for names in owners.values():
        if len(names) > 1:  # different views of one storage: stored independently
            for name in names:
                out[name] = out[name].clone()
    out = {name: t.contiguous().cpu() for name, t in out.items()}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if aliases:
        meta[_ALIASES_KEY] = json.dumps(aliases)
    return write_atomically(path, lambda p: save_file(out, str(p), metadata=meta or None))


def load_tensors(path: str | os.PathLike[str], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read a file written by :func:`save_tensors` (or any safetensors file) onto ``device``."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tensor file at {path}")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no dict
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {_one_line(err)}") from None
    for alias, source in json.loads(meta.get(_ALIASES_KEY, "{}")).items():
        tensors[alias] = tensors[source]
    return tensors


# -- JSON ----------------------------------------------------------------------------------------------


def save_json(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``obj`` as indented JSON (non-finite floats allowed: a loss scale or a loss may be inf)."""
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"  # fails here, before touching the file
    return write_atomically(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def load_json(path: str | os.PathLike[str]) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:  # a flipped byte may break the UTF-8 first
        raise CheckpointError(f"{path} is not valid JSON (damaged?): {_one_line(err)}") from None


# -- torch (weights_only) ------------------------------------------------------------------------------

_PLAIN = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


def save_torch(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` a nest of tensors, numbers, strings and dict/list/tuple/set, after checking that
    ``torch.load(weights_only=True)`` can read every part back (raises TypeError naming the part if not)."""
    _check_loadable(obj, "state")
    return write_atomically(path, lambda p: torch.save(obj, p))


def load_torch(path: str | os.PathLike[str], map_location: torch.device | str = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, no code runs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no state file at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it holds objects other than tensors and plain containers, and loading "
            f"them would run arbitrary code (torch.load(weights_only=True) said: {_one_line(err)})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:  # a truncated file: "[Errno 22] Invalid argument"
        raise CheckpointError(f"{path} is not a readable torch file (damaged?): {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    """The first line of an error's message (torch's carry C++ stack traces on the following ones)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _allowlisted(cls: type) -> bool:
    """A tensor subclass its library registered for ``weights_only`` loading (torchao's 8/4-bit optimizer
    states do, on import), so ``load_torch`` reads it back without running other code."""
    return any(g is cls or (isinstance(g, tuple) and g[0] is cls) for g in torch.serialization.get_safe_globals())


def _check_loadable(obj: Any, where: str) -> None:
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and not _allowlisted(type(obj)):
            raise TypeError(f"save_torch: {where} is a {type(obj).__name__}; save plain tensors (full_tensor())")
        return
    if isinstance(obj, _PLAIN):
        return
    if type(obj) in (dict, OrderedDict, Counter):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise TypeError(f"save_torch: {where} has a key of type {type(key).__name__}")
            _check_loadable(value, f"{where}[{key!r}]")
        return
    if type(obj) in (list, tuple, set):
        for i, value in enumerate(obj):
            _check_loadable(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"save_torch: {where} is a {type(obj).__name__}; only tensors, numbers, strings, None and "
        "dict/list/tuple/set of them can be loaded back without unpickling arbitrary objects"
    )
