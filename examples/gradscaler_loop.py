"""The seed's first level: a plain PyTorch loop with ``mixprec.GradScaler``, a drop-in for torch.amp's.

``torch.amp.GradScaler()`` defaults to CUDA and disables itself on a CPU, so fp16 would run with no loss
scaling; ``mixprec.GradScaler()`` takes its device from the first loss it scales, on any device:

    python examples/gradscaler_loop.py
"""

from __future__ import annotations

import torch

import mixprec
from mixprec.data import CausalLMDataset, stdlib_corpus
from mixprec.models import GPT, GPT_PRESETS

torch.manual_seed(0)
train_tokens, _ = stdlib_corpus(20_000).split(0.1)
train_dataloader = torch.utils.data.DataLoader(CausalLMDataset(train_tokens, seq_len=32), batch_size=8)
model = GPT(GPT_PRESETS["tiny"])
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

scaler = mixprec.GradScaler()  # device comes from the first loss it scales

for step, batch in enumerate(train_dataloader):
    inputs, targets = batch["input_ids"], batch["labels"]
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        outputs = model(inputs, labels=targets)
        loss = outputs.loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    if step == 5:
        break

print(
    f"loss {loss.item():.3f}, scale {scaler.get_scale():g}, skipped {scaler.record.skipped_steps} of "
    f"{scaler.record.steps} steps"
)
