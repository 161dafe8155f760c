"""Many processes: DDP or FSDP2 under torchrun, gradients travelling in bf16 (half the bytes of fp32).

The Accelerator reads torchrun's environment and joins the process group itself (gloo on CPU, nccl on CUDA):

    torchrun --nproc_per_node=2 examples/distributed_comm.py                    # DDP, bf16 on the wire
    torchrun --nproc_per_node=2 examples/distributed_comm.py --distributed fsdp # FSDP2, bf16 reduce-scatter
    python examples/distributed_comm.py                                         # one process works too
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Accelerator

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--distributed", choices=["ddp", "fsdp"], default=None, help="default: DDP under torchrun")
parser.add_argument("--comm-dtype", default="bf16", help="fp32, bf16 or fp16")
args = parser.parse_args()

accelerator = Accelerator(mixed_precision="bf16", distributed=args.distributed, comm_dtype=args.comm_dtype)
torch.manual_seed(0)  # the same initial weights on every process
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(256, 32)
loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # each process gets its share

for inputs, targets in loader:
    loss = nn.functional.mse_loss(model(inputs).float(), targets)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

mean_loss = accelerator.reduce(loss.detach(), "mean")  # the same number on every process
accelerator.print(
    f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
    f"gradients in {args.comm_dtype}: last loss {mean_loss.item():.4f}"
)
accelerator.end_training()
