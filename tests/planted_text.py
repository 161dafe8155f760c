"""A fixed text with structure to learn (the spelling of a few short words), for the watch's planted runs:
made here in milliseconds, where the stdlib corpus takes seconds to read."""

from __future__ import annotations

import functools

import torch

from mixprec.data import to_tensor

WORDS = [
    "the",
    "model",
    "learns",
    "a",
    "small",
    "language",
    "of",
    "short",
    "words",
    "while",
    "its",
    "loss",
    "falls",
    "and",
    "then",
    "it",
    "spikes",
]


@functools.cache
def corpus() -> torch.Tensor:
    """4000 words drawn with a fixed seed, as bytes."""
    picks = torch.randint(0, len(WORDS), (4000,), generator=torch.Generator().manual_seed(0)).tolist()
    return to_tensor(" ".join(WORDS[i] for i in picks).encode())


def random_batch(generator: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """``batch`` windows of ``seq`` bytes of :func:`corpus` at random starts: the planted runs' input ids."""
    data = corpus()
    starts = torch.randint(0, len(data) - seq, (batch,), generator=generator)
    return torch.stack([data[i : i + seq] for i in starts]).long()
