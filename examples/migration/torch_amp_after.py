"""After: the same loop with ``mixprec.GradScaler``: one import changed, loss scaling on, on any device."""

import torch
from _toy import computed_dtypes, toy_model_and_data

import mixprec

model, batches = toy_model_and_data()
seen = computed_dtypes(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = mixprec.GradScaler()  # was torch.amp.GradScaler(): the device comes from the first scaled loss

for batch in batches:
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(batch["inputs"]).float(), batch["targets"])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()

print(
    f"mixprec: computed in {sorted(map(str, seen))}, loss scaling {'on' if scaler.is_enabled() else 'OFF'} "
    f"(scale {scaler.get_scale():g}, {scaler.record.skipped_steps} skipped), loss {loss.item():.4f}"
)
