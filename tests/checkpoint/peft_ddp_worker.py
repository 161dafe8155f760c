"""A peft LoRA model's checkpoints under DDP or FSDP2, on 2 processes (launched by test_peft_ddp.py with torchrun;
not collected by pytest). ``python peft_ddp_worker.py OUT ddp|fsdp``: a Trainer run of 4 steps saving and
evaluating every 2, with ``load_best_model_at_end``; then a second run resumed from its checkpoint-2. Each process
writes OUT/rank<i>.json: whether its adapters equal the best checkpoint's after the first run, and checkpoint-4's
after the resume (every process loads the checkpoints, which hold the adapters only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import peft
import torch
import transformers

from mixprec import Trainer, TrainingArguments
from mixprec.checkpoint import load_tensors


def lora_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    lora = peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0, init_lora_weights=False
    )
    return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    ids = (torch.arange(n).view(n, 1) + torch.arange(16)) % 64
    return [{"input_ids": r, "labels": r} for r in ids]


def run(out: Path, distributed: str, resume: str | None = None) -> Trainer:
    best = {"load_best_model_at_end": True, "metric_for_best_model": "loss", "greater_is_better": True}
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=5e-2,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
        distributed=distributed,
        **({} if resume else best),
    )
    trainer = Trainer(model=lora_gpt2(), args=args, train_dataset=rows(16), eval_dataset=rows(4))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def same_adapters(trainer: Trainer, folder: str) -> bool:
    saved = load_tensors(Path(folder) / "model.safetensors")
    # under FSDP2 each process holds shards: the full tensors are gathered (a collective, same order everywhere)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()}
    mine = {n: p.detach() for n, p in full.items() if p.requires_grad}
    return saved.keys() == mine.keys() and all(torch.equal(saved[n], mine[n]) for n in saved)


def main() -> None:
    out, distributed = Path(sys.argv[1]), sys.argv[2]
    first = run(out / "run", distributed)
    best = first.state.best_model_checkpoint
    resumed = run(out / "resumed", distributed, resume=str(out / "run" / "checkpoint-2"))
    result = {
        "best": Path(best).name,
        "best_loaded": same_adapters(first, best),
        "resumed_exactly": same_adapters(resumed, str(out / "run" / "checkpoint-4")),
    }
    rank = first.accelerator.process_index
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
