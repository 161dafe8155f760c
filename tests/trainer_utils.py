"""Tiny models and datasets for the Trainer tests (and their subprocess scripts). Not collected by pytest.

The task is learnable in a few dozen steps: each token's label is the next id (mod VOCAB). The model has
dropout, so a resume that failed to restore the RNG would change the result.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

VOCAB = 16
SEQ = 8


class DropLM(torch.nn.Module):
    """Embedding -> Linear -> GELU -> Dropout -> Linear, HF-style: ``forward(input_ids, labels=None)``.

    ``returns`` picks the output type the Trainer must understand: "object" (``.loss`` / ``.logits``),
    "dict", "tuple", or "none" (never a loss).
    """

    def __init__(self, width: int = 32, dropout: float = 0.1, returns: str = "object") -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.hidden = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(width, VOCAB)
        self.returns = returns

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.drop(F.gelu(self.hidden(self.embed(input_ids)))))
        loss = None
        if labels is not None and self.returns != "none":
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        if self.returns == "dict":
            return {"loss": loss, "logits": logits}
        if self.returns == "tuple":
            return (loss, logits)
        if self.returns == "none":
            return {"logits": logits}
        return Output(loss, logits)


class Output:
    def __init__(self, loss: torch.Tensor | None, logits: torch.Tensor) -> None:
        self.loss = loss
        self.logits = logits


def make_model(seed: int = 0, **kwargs) -> DropLM:
    torch.manual_seed(seed)
    return DropLM(**kwargs)


def make_examples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A list of dicts, one example each (what a torch Dataset's __getitem__ returns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": (row + 1) % VOCAB} for row in ids]


def accuracy(eval_pred) -> dict[str, float]:
    predictions, label_ids = eval_pred  # the HF contract: unpacks as (predictions, label_ids)
    return {"accuracy": float((predictions.argmax(-1) == label_ids).mean())}


def flat_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs (max |diff| {(a[name] - b[name]).abs().max()})"


def leave(accelerator) -> None:
    """End a torchrun test worker once its results are written: leave the process group (every process
    waits for the others first), then exit without the interpreter's teardown. Why: a finished 2-process gloo
    worker has aborted there (SIGABRT, "terminate called without an active exception": 3 CI runs of 8 in the
    session that wrote this, 1 in 8 by hand), which the launcher reports as a failed job. The cause: a gloo
    worker thread freeing a collective's tensor after the interpreter began shutting down (it needs the GIL,
    and Python ends the thread inside a C++ destructor). end_training() now waits for the backend to let go
    of every tensor mixprec's own collectives lent it (mixprec.strategies.process_group), but collectives
    inside torch (distributed checkpoints, broadcast_object_list) create and drop tensors of their own, which
    these workers also run: hence still the exit without teardown."""
    import os
    import sys

    accelerator.end_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def captured_records(logger: logging.Logger) -> Iterator[list[logging.LogRecord]]:
    """The records ``logger`` emits, caught by a handler on the logger itself, as transformers' CaptureLogger
    does (caplog's root handler misses transformers' loggers, which do not propagate once it configured them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
