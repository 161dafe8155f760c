"""What ``mixprec train`` evaluates on (``EVAL_TOKENS`` of evenly spaced validation windows) and at which batch:
larger than the training batch, where memory allows (issue 36).

An evaluation runs without autograd, so a forward frees each block's activations as the next block starts,
where the training step keeps every block's for its backward. At ``EVAL_BATCH_FACTOR`` times the training batch
an evaluation of a model of at least that many blocks (every built-in preset but ``tiny``, and GPT-2-sized Hugging
Face models) peaks below the training step on those activations. What does not shrink so is the logits:
tokens x vocabulary in the compute dtype, then the fp32 copy and the fp32 log-softmax of the loss
(``LOGITS_BYTES`` per entry), which a chunked training loss never held at once; on GPT-2's 50257 words a
sequence of 1024 tokens takes ~0.5 GB of them. So the batch is also bounded by ``LOGITS_SHARE`` of the memory the
run computes in (the GPU's, or the host's on a CPU), and never below the training batch, which the run already
evaluated at before this rule.

Fewer, larger batches do the same work with fewer kernel launches (a GPU) and fewer thread hand-offs (a CPU
with several threads: on a 2-core Xeon under load, the default run's 512-window evaluation at 2 threads took
31 s at batch 16 and 6-8 s at batch 64, interleaved; at 1 thread the batch sizes ran alike). The validation loss
is the same figure: every window has the same length and the evaluation weights each batch's mean by its size
(tests/cli/test_cli_evaluation.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Subset

from mixprec.cli._epochs import evenly_spaced
from mixprec.data import VOCAB_SIZE

EVAL_TOKENS = 2**16
"""The validation tokens each evaluation reads (evenly spaced windows of the held-out split: 512 of 128 bytes by
default). On the default run's final model they scored 2.270 against 2.282 over the whole split (2,457 windows,
measured); three such evaluations cost ~5% of the run where the whole split would cost ~25%."""

EVAL_BATCH_FACTOR = 4
"""The evaluation batch, in training batches, where the logits allow it."""
EVAL_BATCH_TOKENS = 2**13
"""The evaluation batch's tokens at least, where the logits allow it (the default run's 64 windows of 128): a
training batch of a few short sequences would otherwise read ``EVAL_TOKENS`` in thousands of tiny forwards
(``--batch-size 1 --seq-len 2``: 8,192 of them, 6.2 s of a 5-step run)."""
LOGITS_BYTES = 10
"""Bytes per logit an evaluation holds at its peak: the compute dtype's (2 under bf16/fp16 autocast), the fp32
copy the loss takes, and its fp32 log-softmax."""
LOGITS_SHARE = 1 / 8
"""The share of the device's memory the evaluation's logits may take."""


def device_memory_bytes() -> int | None:
    """The memory of the device a run computes in: the current GPU's, or the host's RAM; None when unknown."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX host
        return None


def eval_batch_size(
    train_batch: int, seq_len: int, vocab_size: int, eval_windows: int, memory_bytes: int | None
) -> int:
    """``EVAL_BATCH_FACTOR`` training batches (``EVAL_BATCH_TOKENS`` at least), at most the batch whose logits
    fit in ``LOGITS_SHARE`` of ``memory_bytes`` (unbounded when None) but never below ``train_batch``, and never
    more than the ``eval_windows`` there are to evaluate."""
    batch = max(train_batch * EVAL_BATCH_FACTOR, EVAL_BATCH_TOKENS // max(1, seq_len))
    if memory_bytes is not None:
        fits = int(memory_bytes * LOGITS_SHARE) // max(1, seq_len * vocab_size * LOGITS_BYTES)
        batch = min(batch, max(train_batch, fits))
    return max(1, min(batch, eval_windows))


def eval_subset(dataset: Any, seq_len: int) -> Any:
    """``EVAL_TOKENS`` of ``dataset``'s windows, evenly spaced (all of them when it holds fewer)."""
    k = max(1, EVAL_TOKENS // seq_len)
    return Subset(dataset, evenly_spaced(len(dataset), k)) if len(dataset) > k else dataset


def subset_tokens(dataset: Any) -> torch.Tensor:
    """Every token of ``dataset``'s windows, in one tensor (for the unigram baseline)."""
    return torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))])


def eval_batch_for(model: torch.nn.Module, train_batch: int, seq_len: int, eval_windows: int) -> int:
    """:func:`eval_batch_size` for ``model`` on this device (its vocabulary; the byte ids at least)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or VOCAB_SIZE
    return eval_batch_size(train_batch, seq_len, vocab, eval_windows, device_memory_bytes())
