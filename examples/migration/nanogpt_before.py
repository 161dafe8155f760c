"""Before: the precision lines of nanoGPT's train.py (Karpathy), around its training step, on a CPU.

nanoGPT picks ``dtype = 'bfloat16' if ... is_bf16_supported() else 'float16'`` and then, on a CPU, uses
``nullcontext()`` instead of autocast: the requested 16-bit dtype is never used there, and the scaler, built
for CUDA, is off. The model is mixprec's GPT, nanoGPT's architecture (nanoGPT's model.py is not a package).
"""

from contextlib import nullcontext

import torch

from mixprec.data import CausalLMDataset, stdlib_corpus
from mixprec.models import GPT, GPT_PRESETS

device = "cpu"
dtype = "float16"  # 'float32', 'bfloat16', or 'float16', the latter will auto implement a GradScaler
device_type = "cuda" if "cuda" in device else "cpu"  # for later use in torch.autocast
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

torch.manual_seed(1337)
data = CausalLMDataset(stdlib_corpus(20_000).split(0.1)[0], seq_len=32)
loader = iter(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
model = GPT(GPT_PRESETS["tiny"])
seen = set()
model.lm_head.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))  # nanoGPT: torch.cuda.amp.GradScaler

for _ in range(6):
    batch = next(loader)
    with ctx:
        loss = model(batch["input_ids"], labels=batch["labels"]).loss  # nanoGPT: logits, loss = model(X, Y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

print(
    f"nanoGPT: asked for {dtype}, computed in {sorted(map(str, seen))}, "
    f"loss scaling {'on' if scaler.is_enabled() else 'OFF'}, loss {loss.item():.3f}"
)
