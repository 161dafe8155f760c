"""The files HF's Trainer leaves in a checkpoint folder that mixprec's own format names otherwise, written
under HF's names beside mixprec's, for the scripts and tools that look for them (issue 34):

    training_args.bin       the run's arguments: a plain dict of ``TrainingArguments.to_dict()``
    rng_state.pth           python/numpy/torch(/CUDA) generators in HF's layout (one process only)

HF's tests and tooling check that these exist and read them with ``torch.load(weights_only=True)``; both are
written through :func:`~mixprec.checkpoint.safe_files.save_torch`, which refuses anything that load could not
read back, so no code runs when they are loaded. HF pickles the ``TrainingArguments`` object itself into
``training_args.bin``, which only ``weights_only=False`` can load; a dict of the same fields is what a script
can read safely (``TrainingArguments(**d)`` rebuilds it). ``config.json`` (an HF model's config) is already
among the trainer's JSON files (:func:`mixprec.trainer.weights.model_config_file`).

mixprec never reads these files back: a resume restores the RNG from ``rng_state_<rank>.pt`` and the
arguments come from the script. They are written into the unfinished folder, so the manifest lists and
checks them like every other file and the folder stays all-or-nothing.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch

ARGS_FILE = "training_args.bin"
RNG_FILE = "rng_state.pth"


def hf_files(args: Any, num_processes: int) -> dict[str, Any]:
    """HF's ``training_args.bin`` and (one process) ``rng_state.pth``, by file name, for the checkpoint's
    ``extra_torch`` (written with :func:`~mixprec.checkpoint.safe_files.save_torch` into the unfinished folder).
    With several processes HF names one RNG file per process, which only that process could write: none is
    written, and HF's loader then resumes without restoring the generators (it says so). The generators are
    read, not advanced, so the run's own RNG file holds the same state."""
    # through JSON: the same plain values as training_args.json (tuples become lists), nothing else
    files: dict[str, Any] = {ARGS_FILE: json.loads(json.dumps(args.to_dict()))}
    if num_processes == 1:
        files[RNG_FILE] = hf_rng_state()
    return files


def hf_rng_state() -> dict[str, Any]:
    """The generators as HF's ``Trainer._load_rng_state`` reads them (``random.setstate(d["python"])``,
    ``np.random.set_state(d["numpy"])``, ``torch.random.set_rng_state(d["cpu"])``), with numpy's key array
    as an int64 tensor (``np.random.set_state`` takes any array-like; an ndarray would need unpickling)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "cpu": torch.random.get_rng_state(),
    }
    # only when CUDA is initialised: asking earlier would initialise it (seconds, and memory on every GPU)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.random.get_rng_state()
    return state
