"""LoRA adapters (peft) on a frozen half-precision base, trained by the Trainer in bf16.

The base is a small GPT-2 built from a config (nothing downloaded) and held in bf16: its frozen weights get no
fp32 copy, no gradient and no optimizer state, which is the memory win; peft keeps the adapters in fp32:

    python examples/lora_half_base.py          # needs peft and transformers: pip install "mixprec[lora]"
"""

from __future__ import annotations

import tempfile

import peft
import torch
import transformers

from mixprec import Trainer, TrainingArguments

torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)  # from_pretrained(path, dtype=torch.bfloat16)
model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["c_attn"]))

text = (b"def main():\n    return 0\n" * 200)[: 32 * 64]
ids = torch.tensor(list(text)).view(64, 32)
data = [{"input_ids": row, "labels": row} for row in ids]

with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out,
        bf16=True,
        max_steps=6,
        learning_rate=1e-2,
        per_device_train_batch_size=8,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()

trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
adapters = {p.dtype for p in model.parameters() if p.requires_grad}
print(
    f"trained {trainable:,} adapter parameters ({adapters}) on a frozen {frozen} base; loss {result.training_loss:.3f}"
)
