"""After: nanoGPT's train.py with two lines changed: the context is ``mixprec.autocast`` on every device, and
the scaler ``mixprec.GradScaler`` (the same ``enabled=(dtype == 'float16')``: one loop for every dtype).

On a CPU the step now runs in the dtype asked for, with loss scaling for float16. Everything else, clipping
after ``unscale_`` included, is nanoGPT's own.
"""

import torch

import mixprec
from mixprec.data import CausalLMDataset, stdlib_corpus
from mixprec.models import GPT, GPT_PRESETS

device = "cpu"
dtype = "float16"  # 'float32', 'bfloat16', or 'float16', the latter will auto implement a GradScaler
device_type = "cuda" if "cuda" in device else "cpu"  # for later use in torch.autocast
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = mixprec.autocast({"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype], device_type=device_type)

torch.manual_seed(1337)
data = CausalLMDataset(stdlib_corpus(20_000).split(0.1)[0], seq_len=32)
loader = iter(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
model = GPT(GPT_PRESETS["tiny"])
seen = set()
model.lm_head.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = mixprec.GradScaler(enabled=(dtype == "float16"))  # was torch.cuda.amp.GradScaler(enabled=...)

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
    f"nanoGPT + mixprec: asked for {dtype}, computed in {sorted(map(str, seen))}, "
    f"loss scaling {'on' if scaler.is_enabled() else 'OFF'}, loss {loss.item():.3f}"
)
