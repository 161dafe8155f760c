"""A small Accelerator loop with dropout, an accumulation window and a scheduler: a resume is exact only if
weights, optimizer, scheduler, loader position and RNG all come back (the state tests and the fault tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import SEQ, VOCAB, TinyLM, TinyOutput
from mixprec import Accelerator


class DropoutLM(TinyLM):
    """TinyLM with dropout, so a resume is exact only if the RNG state is restored too."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TinyOutput:
        h = F.dropout(F.gelu(self.hidden(self.embed(input_ids))), p=0.2, training=self.training)
        logits = self.head(h)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return TinyOutput(loss=loss, logits=logits)


def data(n: int = 40) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row, "labels": (row + 1) % VOCAB} for row in ids]


def setup(precision: str, seed: int = 0, accumulation: int = 1):
    torch.manual_seed(seed)
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=accumulation, verbose=False)
    model = DropoutLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.95**step)
    loader = DataLoader(data(), batch_size=4, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def run(accelerator, model, optimizer, loader, scheduler, stop_after: int | None = None) -> int:
    """Iterate the loader (one epoch, or the rest of one), stopping after ``stop_after`` batches."""
    done = 0
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        done += 1
        if done == stop_after:
            break
    return done
