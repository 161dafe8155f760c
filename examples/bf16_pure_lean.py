"""bf16-pure (weights, gradients and Adam states all bf16, updates stochastically rounded) and low-bit states.

Bytes per parameter counted from the tensors: fp32 + AdamW holds 16 (4 weight + 4 gradient + 8 states),
bf16-pure 8; with 8-bit Adam states (torchao) about 6:

    python examples/bf16_pure_lean.py                          # bf16-pure with mixprec's Bf16AdamW
    python examples/bf16_pure_lean.py --optim adamw_torch_8bit # 8-bit states (torchao; its step compiles first)
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from mixprec import GPT, GPTConfig, Trainer, TrainingArguments
from mixprec.bench.footprint import training_state_bytes
from mixprec.data import CausalLMDataset, stdlib_corpus

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--precision", default="bf16-pure", help="bf16-pure, bf16-pure-kahan, bf16, fp32 ...")
parser.add_argument(
    "--optim",
    default="adamw_torch",
    help="adamw_torch, adamw_torch_8bit, adamw_torch_4bit (adamw_anyprecision: with --precision bf16 or fp32)",
)
args = parser.parse_args()

torch.manual_seed(0)
train_tokens, _ = stdlib_corpus(20_000).split(0.1)
model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32))
with tempfile.TemporaryDirectory() as out:
    training_args = TrainingArguments(
        output_dir=out,
        precision=args.precision,
        optim=args.optim,
        max_steps=6,
        learning_rate=3e-3,
        per_device_train_batch_size=8,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=CausalLMDataset(train_tokens, seq_len=32))
    result = trainer.train()

# weights + one gradient per weight + optimizer state, counted from the tensors (torchao's quantised states
# from the tensors they hold: their element_size() is the dtype they present, not their storage)
held = training_state_bytes(model, trainer.optimizer)
print(
    f"{args.precision} + {args.optim}: weights {next(model.parameters()).dtype}, "
    f"{held['per_param']:.2f} bytes/param (weights + gradients + optimizer state); loss {result.training_loss:.3f}"
)
