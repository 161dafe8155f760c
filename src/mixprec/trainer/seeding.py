"""Seeds and determinism, as HF's ``set_seed`` and ``enable_full_determinism``."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (every device), as HF's ``set_seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_run(seed: int, full_determinism: bool = False) -> None:
    """What the Trainer does before building a model or training: ``set_seed``, or with
    ``full_determinism`` also deterministic kernels."""
    (enable_full_determinism if full_determinism else set_seed)(seed)


def enable_full_determinism(seed: int) -> None:
    """``full_determinism=True``: seeded RNGs and deterministic kernels only (HF's enable_full_determinism);
    an op without a deterministic kernel then raises instead of running."""
    set_seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs a fixed workspace
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
