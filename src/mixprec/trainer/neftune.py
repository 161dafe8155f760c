"""NEFTune (Jain et al., 2023; HF's ``TrainingArguments(neftune_noise_alpha=...)``): uniform noise added to the
input embeddings while training, scaled by ``alpha / sqrt(sequence length * embedding width)``.

The noise is added by a forward hook on ``model.get_input_embeddings()`` that acts only in training mode, so
evaluation and prediction see clean embeddings. The Trainer attaches it for the length of ``train()`` and
removes it afterwards (also when training stops with an error), leaving the model as it was given.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch


def _noise_hook(alpha: float):
    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training or output.dim() < 3:
            return output
        bound = alpha / math.sqrt(output.size(1) * output.size(2))
        return output + torch.empty_like(output).uniform_(-bound, bound)

    return hook


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The model's input embedding module (HF's ``get_input_embeddings()``), or a ValueError naming the fix."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if not isinstance(embeddings, torch.nn.Module):
        raise ValueError(
            f"TrainingArguments(neftune_noise_alpha=...): {type(model).__name__} has no get_input_embeddings() "
            "returning its embedding module, where NEFTune adds its noise; add that method to the model, or "
            "leave neftune_noise_alpha at None"
        )
    return embeddings


@contextlib.contextmanager
def neftune(model: torch.nn.Module, alpha: float | None) -> Iterator[None]:
    """Embedding noise of strength ``alpha`` while the block runs (nothing when ``alpha`` is None)."""
    if alpha is None:
        yield
        return
    handle = input_embeddings(model).register_forward_hook(_noise_hook(float(alpha)))
    try:
        yield
    finally:
        handle.remove()
