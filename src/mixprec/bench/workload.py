"""The work a benchmark repeats: one initial model, a fixed list of batches, a held-out batch.

Every precision trains a fresh copy of the same initial model on the same batches in the same order, so
step times compare like with like and the loss after the run says what the precision did to training.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


@dataclass
class Workload:
    """A model and its data, ready to benchmark. Build one with :func:`workload_from_dataset` or by hand."""

    model: nn.Module
    """The initial model (fp32, on any device). Never trained: each precision gets a deep copy."""
    batches: list[Batch]
    """Training batches (``model(**batch)`` must return an object with ``.loss``), cycled in order."""
    eval_batch: Batch
    """Held-out batch scored after the run."""
    description: str = ""
    """One line for the report (model and data)."""
    flops_per_token: float | None = None
    """Training FLOPs per token, for MFU (None: no MFU)."""
    flops_source: str = ""
    """How ``flops_per_token`` was obtained."""

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("Workload.batches must hold at least one batch")
        if "input_ids" not in self.batches[0]:
            raise ValueError(f"Workload.batches: a batch needs 'input_ids', got keys {sorted(self.batches[0])}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one training batch (batch size x sequence length)."""
        return int(self.batches[0]["input_ids"].numel())

    def fresh_model(self, device: torch.device) -> nn.Module:
        """A deep copy of the initial model on ``device``, in training mode."""
        return copy.deepcopy(self.model).to(device).train()


def estimate_flops_per_token(model: nn.Module, seq_len: int) -> tuple[float, str]:
    """Training FLOPs per token and where the number comes from.

    A model with ``estimate_flops_per_token(seq_len)`` (the built-in GPT: 6N plus the attention term) is
    asked; otherwise 6N over all trainable parameters, which leaves out attention's score matrix.
    """
    estimate = getattr(model, "estimate_flops_per_token", None)
    if callable(estimate):
        return float(estimate(seq_len)), "the model's estimate_flops_per_token: 6N + 12 * n_layer * n_embd * seq_len"
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 6.0 * n, "6N with N = trainable parameters (attention score FLOPs not counted)"


def _collate(items: Sequence[Batch]) -> Batch:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def sample_batches(
    dataset: Sequence[Batch], batch_size: int, count: int, *, seed: int = 0, offset: int = 0
) -> list[Batch]:
    """``count`` batches of ``batch_size`` items drawn without replacement (where the dataset allows) with a
    seeded generator: the same seed gives the same batches in every process."""
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    g = torch.Generator().manual_seed(seed + offset)
    needed = batch_size * count
    order = torch.cat([torch.randperm(len(dataset), generator=g) for _ in range(-(-needed // len(dataset)))])
    idx = order[:needed].tolist()
    return [_collate([dataset[i] for i in idx[k * batch_size : (k + 1) * batch_size]]) for k in range(count)]


def workload_from_dataset(
    model: nn.Module,
    train: Sequence[Batch],
    eval_dataset: Sequence[Batch] | None,
    *,
    batch_size: int,
    num_batches: int,
    seed: int = 0,
    description: str = "",
) -> Workload:
    """A :class:`Workload` of ``num_batches`` seeded batches from ``train`` and one from ``eval_dataset``
    (or from ``train``, a different draw, when there is no eval split)."""
    batches = sample_batches(train, batch_size, num_batches, seed=seed)
    held_out = eval_dataset if eval_dataset is not None and len(eval_dataset) > 0 else train
    eval_batch = sample_batches(held_out, min(batch_size, len(held_out)), 1, seed=seed, offset=1)[0]
    seq_len = int(batches[0]["input_ids"].shape[-1])
    flops, source = estimate_flops_per_token(model, seq_len)
    return Workload(model, batches, eval_batch, description, flops, source)
