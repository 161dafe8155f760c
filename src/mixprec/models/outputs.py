"""The model-output contract: taking the loss out of whatever a model's forward returned.

A model may return an object with ``.loss`` (HF ModelOutput, our CausalLMOutput), a dict with "loss", or a
tuple whose first item is the loss. The Trainer trains on it and the diagnosis measures it, so the one rule
lives here, below both layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def extract_loss(outputs: Any) -> torch.Tensor:
    """Return the loss tensor (a single floating-point element, any shape) from a model's outputs.

    Accepted, in this order: a tensor (the loss itself); an object with a ``.loss`` attribute (Hugging Face
    ``ModelOutput`` and similar); a mapping with a ``"loss"`` key; a tuple or list whose first item is the
    loss. Raises ``ValueError`` saying what was found otherwise, or when the loss is missing (``None``, as HF
    models return when no ``labels`` were passed) or is not a single-element floating tensor.
    """
    loss: Any
    if isinstance(outputs, torch.Tensor):
        loss = outputs
    elif isinstance(outputs, Mapping):
        # checked before the attribute: HF ModelOutput is a Mapping too, and a plain dict has no .loss
        if "loss" not in outputs:
            raise ValueError(
                f"the model returned a mapping without a 'loss' key (keys: {sorted(map(str, outputs))}); "
                "pass labels in the batch or return {'loss': ...}"
            )
        loss = outputs["loss"]
    elif hasattr(outputs, "loss"):
        loss = outputs.loss
    elif isinstance(outputs, (tuple, list)) and len(outputs) > 0:
        loss = outputs[0]
    else:
        raise ValueError(
            f"cannot find a loss in the model's output of type {type(outputs).__name__}; return a tensor, "
            "an object with .loss, a dict with 'loss', or a tuple whose first item is the loss"
        )
    if loss is None:
        raise ValueError("the model returned loss=None; pass labels in the batch so the model computes a loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"the loss must be a tensor, got {type(loss).__name__}")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(
            f"the loss must be a single floating-point value, got shape {tuple(loss.shape)} dtype {loss.dtype}; "
            "reduce it (e.g. .mean()) inside the model"
        )
    return loss  # the model's own tensor (not a reshaped view): callers recognise it by identity
