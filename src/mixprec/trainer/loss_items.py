"""HF's ``num_items_in_batch``: the label tokens of a whole accumulation window, which the Trainer hands to a
``compute_loss_func`` so that a loss summed over tokens and divided by them weighs every token of the window
alike, however the padding falls between its micro-batches (HF 4.46's fix of gradient accumulation). Such a
loss is already the micro-batch's share of the window's: it is not divided by the accumulation steps again.

The window's micro-batches are read from the loader ahead of their steps (:func:`windows`), counted once, and
handed on one at a time with the loader's end-of-data flag as it stood when each was read, so the accumulation
windows are the same as without the count. Counted as HF counts: labels other than -100, shifted by one for a
causal LM's loss (``labels[..., 1:]``), summed over the processes with ``average_tokens_across_devices``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

Count = Callable[[list[Any]], Any]


def label_items(batches: list[Any], shifted: bool) -> torch.Tensor | None:
    """The labels that count in ``batches`` (not -100; without each row's first with ``shifted``), or None
    for batches without a "labels" tensor."""
    if not batches or not all(isinstance(b, Mapping) and isinstance(b.get("labels"), torch.Tensor) for b in batches):
        return None
    return sum((b["labels"][..., 1:] if shifted else b["labels"]).ne(-100).sum() for b in batches)


def counter(model: torch.nn.Module, compute_loss_func: Any, accelerator: Any, across: bool) -> Count | None:
    """How a window's items are counted for ``compute_loss_func`` (None without one: nothing is counted);
    ``across``: summed over the processes (one all-reduce a window)."""
    if compute_loss_func is None:
        return None
    config = getattr(model, "config", None)
    shifted = getattr(model, "loss_type", None) == "ForCausalLM" and not getattr(config, "is_encoder_decoder", False)

    def count(batches: list[Any]) -> torch.Tensor | None:
        items = label_items(batches, shifted)
        if items is not None and across and accelerator.num_processes > 1:
            items = accelerator.reduce(items.to(accelerator.device), reduction="sum")
        return items

    return count


def windows(batches: Iterable[Any], count: Count | None, gradients: Any) -> Iterator[tuple[Any, Any]]:
    """``(micro-batch, its window's item count)`` for each of ``batches``; the count is None without ``count``
    (then nothing is read ahead). ``gradients``: the Accelerator's gradient state (its accumulation steps),
    whose ``end_of_dataloader`` is put back as it was when each micro-batch was read."""
    if count is None:
        yield from ((batch, None) for batch in batches)
        return
    loader = iter(batches)
    while True:
        window: list[tuple[Any, bool]] = []
        for batch in loader:
            window.append((batch, gradients.end_of_dataloader))
            if len(window) == gradients.accumulation_steps or gradients.end_of_dataloader:
                break
        if not window:
            return
        items = count([batch for batch, _ in window])
        for batch, last in window:
            gradients.end_of_dataloader = last
            yield batch, items
