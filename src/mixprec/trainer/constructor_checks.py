"""What ``Trainer(...)`` refuses before it builds anything, each with the fix: argument pairs that contradict
each other (as HF refuses them) and a model that is missing or not a module."""

from __future__ import annotations

from typing import Any

import torch


def check_optimizer_arguments(model_init: Any, optimizers: tuple[Any, Any], cls_and_kwargs: Any) -> None:
    """``optimizers`` beside ``optimizer_cls_and_kwargs`` or ``model_init``: one source of the optimizer."""
    if cls_and_kwargs is not None and optimizers[0] is not None:
        raise ValueError(
            "Trainer(optimizers=..., optimizer_cls_and_kwargs=...): pass one of them (an optimizer, or the "
            "class and keyword arguments the Trainer builds it from)"
        )
    if model_init is not None and optimizers != (None, None):
        raise ValueError(
            "Trainer(model_init=..., optimizers=...): a model built by model_init needs its own optimizer; "
            "leave optimizers out (optimizer_cls_and_kwargs=(cls, kwargs) builds one for each model), or "
            "subclass Trainer and override create_optimizer"
        )


def check_model(model: Any) -> None:
    """The model to train (given, or built by ``model_init``): a ``torch.nn.Module``."""
    if model is None:
        raise ValueError("Trainer(model=None): pass the torch.nn.Module to train (or model_init=...)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Trainer(model=...): expected a torch.nn.Module, got {type(model).__name__}")
