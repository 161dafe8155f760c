"""The seed's second snippet, runnable: a hand-written loop with ``mixprec.Accelerator``.

Trains the built-in GPT ("tiny" preset) on the embedded corpus (this Python's standard library source,
nothing to download), in the precision you ask for, in one process or many:

    python examples/accelerator_loop.py                          # fp16 on this machine's device
    python examples/accelerator_loop.py --max-steps 10 --corpus-bytes 50000    # a quick check
    python examples/accelerator_loop.py --precision bf16 --epochs 2
    torchrun --nproc_per_node=2 examples/accelerator_loop.py     # DDP, one machine
    torchrun --nproc_per_node=2 examples/accelerator_loop.py --distributed fsdp
    # several machines: run on each, with its own --node_rank
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=host0:29500 examples/accelerator_loop.py

The loop is the seed's, plus gradient accumulation, clipping and a checkpoint. With ``--project-dir DIR
--save-every N`` it saves a numbered checkpoint every N steps and, restarted by ``torchrun --max-restarts``
after a lost process, continues from the newest one (the one line ``accelerator.resume_after_restart()``):

    torchrun --nproc_per_node=2 --max-restarts=3 examples/accelerator_loop.py --project-dir runs/x --save-every 20
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch.utils.data import DataLoader

from mixprec import Accelerator, ProjectConfiguration
from mixprec.data import CausalLMDataset, stdlib_corpus
from mixprec.models import GPT, GPT_PRESETS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="fp16", help="no | fp32 | fp16 | bf16 | auto (default fp16)")
    p.add_argument("--distributed", default=None, choices=["ddp", "fsdp"], help="default: DDP under torchrun")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=200_000, help="how much of the corpus to train on")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--save", default=None, metavar="DIR", help="save_state(DIR) at the end")
    p.add_argument("--project-dir", default=None, metavar="DIR", help="numbered checkpoints in DIR/checkpoints")
    p.add_argument("--save-every", type=int, default=50, metavar="N", help="with --project-dir (default 50)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Progress:
    """Where the loop is (epoch, optimizer steps), saved and restored with the rest of the state."""

    def __init__(self) -> None:
        self.epoch = self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # same initial weights and data order on every process

    train_tokens, _ = stdlib_corpus(args.corpus_bytes).split(0.1)
    dataset = CausalLMDataset(train_tokens, seq_len=args.seq_len)
    config = GPT_PRESETS["tiny"]
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    train_dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    # optimizer steps of each process: prepared, the loader gives each process its share of the batches, and
    # the last batch of an epoch always steps (accumulate() knows it is the last): round up; --max-steps
    # counts the same steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = args.epochs * math.ceil(math.ceil(len(train_dataloader) / world) / args.accumulation)
    steps = min(steps, args.max_steps or steps)
    # accelerate's convention: a prepared scheduler ticks once per process per optimizer step
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(steps * world, 1))

    # --- the seed's snippet ---------------------------------------------------------------------------
    accelerator = Accelerator(
        mixed_precision=args.precision,
        gradient_accumulation_steps=args.accumulation,
        distributed=args.distributed,
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    progress = Progress()
    if args.project_dir:
        accelerator.register_for_checkpointing(progress)
        accelerator.resume_after_restart()  # after a lost process: the newest checkpoint, data position included
    accelerator.print(
        f"{len(dataset)} sequences of {args.seq_len} bytes, {len(train_dataloader)} batches per process per epoch, "
        f"{accelerator.num_processes} process(es)"
    )
    start, tokens, step = time.perf_counter(), 0, progress.step
    for epoch in range(progress.epoch, args.epochs):
        for batch in train_dataloader:
            if step == steps:
                break
            with accelerator.accumulate(model):
                inputs, targets = batch["input_ids"], batch["labels"]
                outputs = model(inputs, labels=targets)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            tokens += inputs.numel() * accelerator.num_processes
            if accelerator.sync_gradients:
                step += 1
                if args.project_dir and step % args.save_every == 0:
                    progress.epoch, progress.step = epoch, step
                    accelerator.save_state()
                if step % 20 == 0 or step == steps:
                    mean_loss = accelerator.reduce(loss.detach(), "mean").item()
                    accelerator.print(
                        f"epoch {epoch} step {step}/{steps}  loss {mean_loss:.3f}  "
                        f"lr {lr_scheduler.get_last_lr()[0]:.2e}  scale {accelerator.scaler.get_scale():g}"
                        f"{'  (skipped)' if accelerator.optimizer_step_was_skipped else ''}"
                    )
    # --------------------------------------------------------------------------------------------------
    elapsed = time.perf_counter() - start
    record = accelerator.scaler.record
    accelerator.print(
        f"done: {record.steps} optimizer steps ({record.skipped_steps} skipped), {tokens / elapsed:,.0f} "
        f"tokens/s, precision {accelerator.mixed_precision}"
    )
    if args.save:
        path = accelerator.save_state(args.save)
        accelerator.print(f"state saved to {path}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
