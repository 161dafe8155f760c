"""The on-disk cache of "auto" decisions: a repeated run on the same machine, torch, model and batch shape
reuses the measurement instead of racing again. Beside each race's entry, what compiling its chosen mode cost
(``<key>/compile/<mode>``: compile_choice.py's figures), for a later run asked to compile where it pays.

Where: ``$MIXPREC_AUTO_CACHE`` if set to a file path; else ``$XDG_CACHE_HOME/mixprec/auto-precision.json``
(``~/.cache/mixprec/auto-precision.json``). ``MIXPREC_AUTO_CACHE=0`` (or ``off``) neither reads nor writes
it, which forces a fresh measurement; deleting the file does the same once.

The key covers everything the timing depends on: the processor (model name and instruction-set flags) or
GPU, torch's version, the thread count, the number of processes, the candidates, the models' parameter
names/shapes/dtypes and the batch's shapes/dtypes. A change in any of them measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mixprec.precision.decision import AutoDecision
from mixprec.tree import tree_leaves

_OFF = {"0", "off", "false", "no", "none", ""}


def cache_file() -> Path | None:
    """The cache's path, or None when ``MIXPREC_AUTO_CACHE`` turns it off."""
    env = os.environ.get("MIXPREC_AUTO_CACHE")
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mixprec" / "auto-precision.json"


def device_identity(device: torch.device) -> str:
    """The hardware a timing belongs to: the GPU's name and capability, or the CPU's model and flags."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        model = platform.processor() or platform.machine()
    return f"{device.type}:{model}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def shapes_of(tree: Any) -> list[str]:
    """Shapes and dtypes of the tensors in a nested batch (dicts, tuples, dataclasses...)."""
    return [f"{tuple(t.shape)}:{t.dtype}" for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def fingerprint(
    device: torch.device,
    models: Sequence[torch.nn.Module],
    batch_signature: Sequence[str],
    candidates: Sequence[str],
    processes: int,
) -> str:
    parts = {
        "device": device_identity(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
        "processes": processes,
        "candidates": list(candidates),
        "models": [
            [type(m).__qualname__, [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in m.named_parameters()]] for m in models
        ],
        "batch": list(batch_signature),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _entries() -> dict[str, Any]:
    path = cache_file()
    if path is None or not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError):  # a damaged cache is a cache miss, never an error
        return {}


def lookup(key: str) -> AutoDecision | None:
    entry = _entries().get(key)
    try:
        return AutoDecision.from_dict(entry) if isinstance(entry, dict) else None
    except TypeError:
        return None


def store(key: str, decision: AutoDecision) -> None:
    """Add the decision to the cache file (atomically; best effort: a read-only home just skips it)."""
    _write(key, decision.to_dict())


def _compile_key(key: str, mode: str) -> str:
    # apart from the race's entry: a race run again (its re-check off) still finds what compiling this mode cost
    return f"{key}/compile/{mode}"


def lookup_compile(key: str, mode: str) -> dict[str, Any]:
    """What compiling ``mode`` measured on an earlier run with the race key ``key`` (compile_choice.py's
    figures), or {} if none did."""
    entry = _entries().get(_compile_key(key, mode))
    return entry if isinstance(entry, dict) else {}


def store_compile(key: str, mode: str, figures: dict[str, Any]) -> None:
    """Keep what compiling ``mode`` measured on this run, for the next run with the race key ``key``."""
    _write(_compile_key(key, mode), figures)


def with_cached_compile(key: str, decision: AutoDecision) -> AutoDecision:
    """``decision`` with what compiling its chosen mode measured on an earlier run (if one did), as "cache"."""
    prior = lookup_compile(key, decision.chosen)
    return dataclasses.replace(decision, compile={**prior, "source": "cache"}) if prior else decision


def _write(key: str, value: dict[str, Any]) -> None:
    path = cache_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            entries = {}
        entries[key] = value
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".auto-precision.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
