"""``Accelerator.save_model``: a model's full weights in the Hugging Face layout, for ``from_pretrained``,
accelerate's ``load_checkpoint_in_model`` and anything else that reads it.

Layout (what transformers and accelerate read)::

    model.safetensors                       one file, when it fits in max_shard_size
    model-00001-of-00003.safetensors ...    else shards in parameter order,
    model.safetensors.index.json            and {"metadata": {"total_size": bytes}, "weight_map": {name: file}}

and ``pytorch_model.bin`` / ``pytorch_model-0000i-of-0000n.bin`` / ``pytorch_model.bin.index.json`` with
``safe_serialization=False`` (torch.save files; mixprec reads them back with ``weights_only=True``).

The weights come from the distributed strategy (``model_state_dict``: gathered in full under FSDP2, a
collective), so every process must call ``save_model``; only the main process writes. Each file appears
whole or not at all (written aside, fsynced, renamed); the index is written last, and shards of an earlier
save that the new one does not use are deleted after it, so a reader never finds an index naming a
missing file. Other files in the folder (a config, a tokenizer) are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint import save_json, save_tensors, save_torch

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "10GB" (10**9) or "5GiB" (5 * 2**30), as HF reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"save_model(max_shard_size={size!r}): must be a positive number of bytes")
        return size
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(
            f"save_model(max_shard_size={size!r}): give bytes as an int or a string like '10GB', '500MB' or '2GiB'"
        )
    return max(1, int(float(match.group(1)) * _UNITS[match.group(2).upper()]))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def split_shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow this one. A tensor bigger
    than ``max_bytes`` gets a shard of its own (as HF does). Tied entries count once."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        cost = 0 if key in seen else _nbytes(tensor)
        seen.add(key)
        if shards[-1] and size + cost > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += cost
    return shards


def write_model(
    state: Mapping[str, torch.Tensor], directory: str | Path, *, max_shard_size: int | str, safe_serialization: bool
) -> list[Path]:
    """Write ``state`` in the HF layout into ``directory`` (see the module docstring); returns the files."""
    folder = Path(directory)
    on_meta = [name for name, t in state.items() if t.device.type == "meta"]
    if on_meta:  # offloaded (big-model dispatch) or never materialised: there are no values to write
        raise ValueError(
            f"save_model: {on_meta[0]!r} (and {len(on_meta) - 1} more) are on the meta device, so they hold no "
            "values; load the weights into the model (off the meta device) before saving it"
        )
    if folder.is_file():
        raise ValueError(f"save_model: {folder} is a file; give a folder")
    folder.mkdir(parents=True, exist_ok=True)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    shards = split_shards(state, parse_size(max_shard_size))
    n = len(shards)
    names = [f"{stem}.{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
    written = []
    for name, shard in zip(names, shards):
        if safe_serialization:  # "format": "pt" is what transformers' from_pretrained checks for
            written.append(save_tensors(shard, folder / name, metadata={"format": "pt"}))
        else:
            written.append(save_torch({k: v.detach().cpu() for k, v in shard.items()}, folder / name))
    index = folder / f"{stem}.{ext}.index.json"
    if n > 1:
        total = sum(_nbytes(t) for t in state.values())
        weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
        written.append(save_json({"metadata": {"total_size": total}, "weight_map": weight_map}, index))
    else:
        index.unlink(missing_ok=True)  # a stale index would point loaders at the shards deleted below
    _remove_stale_shards(folder, stem, ext, keep=set(names))
    return written


def _remove_stale_shards(folder: Path, stem: str, ext: str, keep: set[str]) -> None:
    pattern = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{ext}")
    for path in folder.iterdir():
        if pattern.fullmatch(path.name) and path.name not in keep and path.is_file():
            path.unlink()


def save_model(
    strategy: Any, model: torch.nn.Module, directory: str | Path, *, max_shard_size: int | str, safe_serialization: bool
) -> None:
    """Gather ``model``'s full weights through ``strategy`` (a collective under FSDP2) and write them on the
    main process; every process returns once the files are there, or raises if the main one failed."""
    parse_size(max_shard_size)  # a bad value fails on every process, before the collective
    state = strategy.model_state_dict(model)
    error: BaseException | None = None
    if state is not None:
        try:
            write_model(state, directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        except Exception as err:  # reported to the other processes, then raised
            error = err
    if not strategy.all_true(error is None):
        raise error if error is not None else RuntimeError(f"save_model({str(directory)!r}): the main process failed")
