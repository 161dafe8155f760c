"""``TrainingArguments(activation_checkpointing=True)`` (HF 5's name; ``gradient_checkpointing`` is its alias):
ask the model to recompute activations in the backward pass instead of storing them.

As in HF's Trainer, the model does the work: ``activation_checkpointing_enable(**kwargs)`` (HF 5 models) or
``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` (HF 4 models, mixprec's GPT). A model
with neither cannot be checkpointed from outside without knowing its layers, so it is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch


def enable_activation_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any] | None) -> None:
    """Turn on activation checkpointing in ``model``; raise ValueError if it has no way to."""
    rest = dict(kwargs or {})
    # HF's Trainer takes these two out for the model method; the rest go to torch.utils.checkpoint
    layer_kwargs = {k: rest.pop(k) for k in ("every_n_layers", "offload") if k in rest}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=rest or None, **layer_kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=rest or None, **layer_kwargs)
    else:
        raise ValueError(
            f"TrainingArguments(activation_checkpointing=True): {type(model).__name__} has no "
            "gradient_checkpointing_enable() or activation_checkpointing_enable(); wrap its layers in "
            "torch.utils.checkpoint.checkpoint yourself, or turn the argument off"
        )
