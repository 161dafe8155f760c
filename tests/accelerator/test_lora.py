"""peft LoRA on a frozen fp16/bf16 base, as users write it: ``get_peft_model`` on a tiny GPT-2 built from a config
(nothing downloads), trained at the Accelerator and the Trainer levels in the asked precision, checkpointed and
resumed exactly, saved as an adapter (as HF's Trainer saves a PeftModel)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from mixprec import Accelerator, Trainer, TrainingArguments  # noqa: E402

VOCAB, SEQ = 64, 16
CASES = [("fp16", torch.float16), ("bf16", torch.bfloat16)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def lora_gpt2(dtype: torch.dtype, adapters_in_fp32: bool = True) -> torch.nn.Module:
    """A tiny GPT-2 in ``dtype`` under LoRA adapters on its attention projection. peft upcasts adapters to fp32
    by default (``autocast_adapter_dtype=True``); ``False`` leaves them in ``dtype``: fp32 masters train them."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, initializer_range=0.1
    )  # a wider init than GPT-2's 0.02: adapters on a near-uniform base barely move the loss in a few steps
    base = transformers.GPT2LMHeadModel(config).to(dtype)
    targets = ["c_attn", "c_proj", "c_fc"]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(base, lora, autocast_adapter_dtype=adapters_in_fp32)


def rows(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 4, (n, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % VOCAB  # a predictable next token, so the loss falls within a few steps
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]


def matmul_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The output dtype of every matmul layer call: GPT-2's Conv1D (addmm), LoRA's and the head's Linear."""
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, transformers.pytorch_utils.Conv1D)):
            m.register_forward_hook(lambda mod, inputs, out: seen.add(out.dtype))
    return seen


def frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("adapters_in_fp32", [True, False], ids=["peft-fp32-adapters", "half-adapters"])
@pytest.mark.parametrize(("precision", "dtype"), CASES)
def test_lora_trains_at_the_accelerator_level(precision, dtype, adapters_in_fp32):
    model = lora_gpt2(dtype, adapters_in_fp32)
    frozen = frozen_state(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32 if adapters_in_fp32 else dtype}
    seen = matmul_dtypes(model)
    accelerator = Accelerator(mixed_precision=precision, verbose=False)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(trainable, lr=5e-2))
    data = rows(16)
    losses = []
    for step in range(8):
        batch = {k: torch.stack([r[k] for r in data[4 * (step % 4) : 4 * (step % 4) + 4]]) for k in data[0]}
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert seen == {dtype}  # every matmul, the frozen base's and the adapters', in the asked precision
    assert sum(losses[-2:]) < sum(losses[:2])
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.dtype == dtype and torch.equal(p, frozen[name]), name
    assert {t.dtype for s in optimizer.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    assert {p.dtype for g in optimizer.param_groups for p in g["params"]} == {torch.float32}


def lora_args(tmp_path, precision: str, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-2,
        logging_steps=1,
        save_steps=3,
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
        **{precision: True},
        **kw,
    )


@pytest.mark.parametrize(("precision", "dtype"), CASES)
def test_lora_trains_resumes_exactly_and_saves_the_adapter_at_the_trainer_level(tmp_path, precision, dtype):
    model = lora_gpt2(dtype, adapters_in_fp32=precision == "bf16")  # fp16: half adapters through fp32 masters
    frozen = frozen_state(model)
    seen = matmul_dtypes(model)
    trainer = Trainer(model=model, args=lora_args(tmp_path / "run", precision), train_dataset=rows(24))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert seen == {dtype}
    assert sum(losses[-2:]) < sum(losses[:2])
    assert all(p.dtype == dtype and torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    straight = adapters(model)

    # the checkpoint holds the adapters, as peft saves them: the frozen base is the model the user loads
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "run" / "checkpoint-3" / "model.safetensors")
    assert set(saved) == {n for n, p in model.named_parameters() if p.requires_grad}

    # resume from the step-3 checkpoint in a fresh process-like setting: a new model, a new Trainer
    again = lora_gpt2(dtype, adapters_in_fp32=precision == "bf16")
    resumed = Trainer(model=again, args=lora_args(tmp_path / "run", precision), train_dataset=rows(24))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    for name, value in adapters(again).items():
        assert torch.equal(value, straight[name]), name
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e] == losses

    # save_model of a PeftModel writes the adapter (as HF's Trainer does), which loads back onto a fresh base
    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()
    base = lora_gpt2(dtype).get_base_model()
    reloaded = peft.PeftModel.from_pretrained(base, str(out))
    mine = dict(model.named_parameters())
    for name, p in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(p.to(mine[name].dtype), mine[name]), name


def test_load_best_model_at_end_restores_the_best_checkpoints_adapters_over_the_frozen_base(tmp_path):
    from safetensors.torch import load_file

    model = lora_gpt2(torch.bfloat16)
    frozen = frozen_state(model)
    args = lora_args(
        tmp_path,
        "bf16",
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
    )  # the worse: checkpoint-3
    trainer = Trainer(model=model, args=args, train_dataset=rows(24), eval_dataset=rows(8, seed=1))
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-3")
    best = load_file(tmp_path / "checkpoint-3" / "model.safetensors")
    for name, p in model.named_parameters():
        expected = best[name] if p.requires_grad else frozen[name]
        assert torch.equal(p, expected), name


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_trainer_checkpoint_of_a_peft_model_loads_with_peft_as_hfs_does(tmp_path, async_save):
    import json

    model = lora_gpt2(torch.bfloat16)
    args = lora_args(tmp_path, "bf16", async_save=async_save)
    Trainer(model=model, args=args, train_dataset=rows(24)).train()
    folder = tmp_path / "checkpoint-6"  # the last: the model's adapters now
    # peft's files, listed and checksummed in the manifest like every file of the folder
    listed = json.loads((folder / "manifest.json").read_text())["files"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(listed)
    # no base config.json: from_pretrained("checkpoint-N") would build a random model from it, silently
    assert not (folder / "config.json").exists()
    reloaded = peft.PeftModel.from_pretrained(lora_gpt2(torch.bfloat16).get_base_model(), str(folder))
    mine = dict(model.named_parameters())
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, mine[name]), name  # the checkpoint's adapters over the same frozen base
