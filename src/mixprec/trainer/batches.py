"""One batch and the model: how a batch reaches the model and gives its loss (the one rule training,
evaluation and the diagnosis share), and what a batch counts (samples, tokens) for the meter and HF's
``num_input_tokens_seen``. The DataLoaders that make the batches are :mod:`mixprec.loaders.from_datasets`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixprec.models.outputs import extract_loss  # one loss rule, shared with the diagnosis


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """How a batch reaches the model, in training and evaluation alike: ``model(**batch)`` for dict batches
    (the HF convention), ``model(*batch)`` for tuples (a ``TensorDataset``), ``model(batch)`` otherwise."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_and_outputs(
    model: torch.nn.Module, batch: Any, compute_loss_func: Any = None, num_items_in_batch: Any = None
) -> tuple[torch.Tensor, Any]:
    """A batch's loss and the model's outputs, the one rule training and evaluation share (the Trainer's
    ``compute_loss``): the model's own loss, or with HF's ``compute_loss_func`` (and labels in a dict batch)
    that function's on the outputs and the labels, which the model then does not see."""
    if compute_loss_func is not None and isinstance(batch, Mapping) and "labels" in batch:
        outputs = call_model(model, {k: v for k, v in batch.items() if k != "labels"})
        return compute_loss_func(outputs, batch["labels"], num_items_in_batch=num_items_in_batch), outputs
    outputs = call_model(model, batch)
    return extract_loss(outputs), outputs


def count_tokens(batch: Any) -> int:
    """Tokens in a batch (``input_ids.numel()``: host metadata, no device sync); 0 when there are none."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def count_input_tokens(batch: Any, mode: str, main_input_name: str = "input_ids") -> int | torch.Tensor:
    """Input tokens of a batch for HF's ``include_num_input_tokens_seen``: ``"all"`` counts the elements of
    ``batch[main_input_name]`` (host metadata), ``"non_padding"`` sums ``attention_mask`` (a device tensor:
    reading it is a sync) or, without a mask, counts every element. 0 when the batch has no such input."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get(main_input_name), torch.Tensor):
        return 0
    mask = batch.get("attention_mask")
    if mode == "non_padding" and isinstance(mask, torch.Tensor):
        return mask.sum()
    return int(batch[main_input_name].numel())


def input_tokens_seen(accelerator: Any, batch: Any, mode: str, main_input_name: str) -> int:
    """A micro-batch's share of HF's ``state.num_input_tokens_seen``, summed over processes (as HF: one
    collective per micro-batch under several processes, and a sync per micro-batch for "non_padding")."""
    seen = count_input_tokens(batch, mode, main_input_name)
    if accelerator.num_processes > 1:
        seen = accelerator.reduce(torch.as_tensor(seen, dtype=torch.int64, device=accelerator.device))
    return int(seen)


def count_samples(batch: Any) -> int:
    """Examples in a batch: the leading dimension of its first tensor (no device sync)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0
