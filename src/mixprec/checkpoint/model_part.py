"""Which part of a model a checkpoint holds: all of its state dict, or, for a peft model, its trainable
parameters only (the adapters and peft's ``modules_to_save``), as peft and HF's Trainer save one.

A LoRA run's frozen base is the model the user loads (from its own folder) every time: copying it into every
``checkpoint-N`` would cost its whole size per checkpoint (14 GB for a 7B model in bf16) for bytes that never
change. At load the state is completed from the prepared model's own base, so ``load_state`` still loads a
whole state dict, through the distributed strategy like any other. A full state saved before (or for a
model that is not a peft model) loads as it always did.
"""

from __future__ import annotations

from typing import Any

import torch


def saved_keys(model: torch.nn.Module) -> set[str] | None:
    """The state-dict keys a checkpoint of ``model`` holds: its trainable parameters' for a peft model (whose
    frozen base is loaded from its own folder); None for every other model (all of them)."""
    # peft is not imported for this: a PeftModel is a peft class holding a peft_config. Its class's bases
    # count: FSDP2's fully_shard swaps in a subclass of torch's making (FSDPPeftModelForCausalLM)
    peft_class = any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)
    if not (peft_class and hasattr(model, "peft_config")):
        return None
    return {name for name, p in model.named_parameters() if p.requires_grad}


def saved_part(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """``state`` (a full state dict, or None on a process that writes nothing) cut to :func:`saved_keys`."""
    keys = saved_keys(model)
    if keys is None or state is None:
        return state
    return {name: tensor for name, tensor in state.items() if name in keys}


def completed(strategy: Any, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the entries a checkpoint leaves out (a peft model's frozen base) taken from ``model``
    itself, through the distributed strategy's ``model_state_dict``, so that loading it changes only what was
    saved. Collective under FSDP2 (the model's full state is gathered); elsewhere the entries are the model's
    own tensors, not copies.

    The strategy gives the full state to the main process only. Every other process completes ``state`` from
    its own module: under DDP (and any strategy that replicates the model) each process loads the dict it is
    given, so an adapters-only one would fail there as missing keys; under FSDP2 the dict of a process other
    than the main one is not read (the main process's is scattered), and ``state_dict()`` is its own shards,
    no copy and no collective."""
    if saved_keys(model) is None:
        return state
    full = strategy.model_state_dict(model)  # every process calls it: a collective under FSDP2
    return {**(full if full is not None else model.state_dict()), **state}
