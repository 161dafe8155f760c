"""After: the same loop with ``from mixprec import Accelerator``: fp16 autocast and loss scaling, on a CPU too.

The rest of the script is unchanged; the Accelerator prints the precision it runs in, and why.
"""

import torch
from _toy import computed_dtypes, toy_model_and_data

from mixprec import Accelerator  # was: from accelerate import Accelerator

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

print(f"mixprec: computed in {sorted(map(str, seen))}, loss {loss.item():.4f}")
