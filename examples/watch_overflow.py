"""The precision watch with a planted overflow: one batch drives a layer past fp16's max (65504).

The step is skipped by the loss scaler; the watch replays it and names the module whose output went
non-finite first, in the log and in its summary:

    python examples/watch_overflow.py
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mixprec import Accelerator

logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # the watch warns through logging


class Regressor(nn.Module):
    """Called with keyword batches and returning its loss, so the watch can replay a skipped step."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.down(self.act(self.up(inputs)))
        return {"loss": nn.functional.mse_loss(prediction.float(), targets)}


torch.manual_seed(0)
model = Regressor()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

accelerator = Accelerator(mixed_precision="fp16", watch=1)  # sample every step (the default is every 100)
model, optimizer = accelerator.prepare(model, optimizer)

for step in range(6):
    batch = {"inputs": torch.randn(8, 16), "targets": torch.randn(8, 1)}
    if step == 3:
        batch["inputs"] = batch["inputs"] * 1e5  # planted: "up"'s fp16 output overflows, the loss turns inf
    loss = model(**batch)["loss"]
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

summary = accelerator.watch.summary()
print(f"skipped steps by module: {summary['skipped_steps_by_module']}")
for skip in summary["skips"]:
    print(f"step {skip['step']}: first non-finite in {skip['module']!r} ({skip['phase']}, {skip['what']})")
