"""Before: a torch.amp fp16 loop, as PyTorch's AMP recipe writes it, run on a CPU.

``torch.amp.GradScaler()`` defaults to device "cuda"; on a machine without CUDA it warns and disables itself,
so the fp16 steps run with no loss scaling at all (small gradients flush to zero).
"""

import torch
from _toy import computed_dtypes, toy_model_and_data

model, batches = toy_model_and_data()
seen = computed_dtypes(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler()

for batch in batches:
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(batch["inputs"]).float(), batch["targets"])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()

print(
    f"torch.amp: computed in {sorted(map(str, seen))}, loss scaling {'on' if scaler.is_enabled() else 'OFF'}, "
    f"loss {loss.item():.4f}"
)
