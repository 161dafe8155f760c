"""Capture and restore every global random generator a training step may draw from.

The state is made of tensors, ints and floats only, so :func:`~mixprec.checkpoint.safe_files.save_torch`
writes it and ``torch.load(weights_only=True)`` reads it back (numpy's key array becomes a tensor).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The python, numpy, torch (CPU) and, where CUDA is in use, every CUDA device's generator state."""
    return rng_snapshot()()


def rng_snapshot() -> Callable[[], dict[str, Any]]:
    """The generators' states taken now, as a function that returns :func:`rng_state`'s dict when called: an
    asynchronous save converts them on its writer thread (the conversion is most of the capture's cost)."""
    python = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    cpu = torch.get_rng_state()
    # Only when CUDA was initialised: asking earlier would initialise it (seconds, and memory on every GPU).
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return functools.partial(_as_saved, python, numpy_state, cpu, cuda)


def _as_saved(python: tuple[Any, ...], numpy_state: tuple[Any, ...], cpu: torch.Tensor, cuda: Any) -> dict[str, Any]:
    version, internal, gauss = python
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": cpu,
    }
    if cuda is not None:
        state["cuda"] = cuda
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured. CUDA states are restored when both sides have CUDA."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, int(npy["pos"]), int(npy["has_gauss"]), float(npy["cached_gaussian"])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(list(state["cuda"])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
