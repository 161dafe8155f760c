"""Before: an HF Accelerate loop with ``mixed_precision="fp16"``, run on a CPU.

accelerate runs no autocast for fp16 on a CPU: every op stays fp32, silently.
"""

import torch
from _toy import computed_dtypes, toy_model_and_data
from accelerate import Accelerator

model, batches = toy_model_and_data()
seen = computed_dtypes(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

accelerator = Accelerator(mixed_precision="fp16", cpu=True)
model, optimizer = accelerator.prepare(model, optimizer)

for batch in batches:
    loss = torch.nn.functional.mse_loss(model(batch["inputs"]).float(), batch["targets"])
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

print(f"accelerate: computed in {sorted(map(str, seen))}, loss {loss.item():.4f}")
