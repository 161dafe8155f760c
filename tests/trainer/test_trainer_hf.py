"""Hugging Face models and datasets through the Trainer, unchanged: a GPT-2 from a small config (nothing is
downloaded) trains in fp16 and in bf16 on a ``datasets`` split, and saves with save_pretrained."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from mixprec import Trainer, TrainingArguments  # noqa: E402

VOCAB, SEQ = 64, 16


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def lm_split(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # a repeating pattern per row, so the next token is predictable and the loss can fall
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()}
    )


def matmul_output_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    # GPT-2's projections are transformers' Conv1D (an addmm), its head an nn.Linear
    seen: set[torch.dtype] = set()
    kinds = (torch.nn.Linear, transformers.pytorch_utils.Conv1D)
    for m in model.modules():
        if isinstance(m, kinds):
            m.register_forward_hook(lambda mod, inputs, out: seen.add(out.dtype))
    return seen


@pytest.mark.parametrize(("flag", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_hf_gpt2_trains_in_low_precision_on_a_datasets_split(tmp_path, flag, dtype):
    model = tiny_gpt2()
    dtypes = matmul_output_dtypes(model)
    dataset = datasets.DatasetDict({"train": lm_split(64, 0), "validation": lm_split(16, 1)})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        eval_strategy="epoch",
        num_train_epochs=2,
        learning_rate=3e-3,
        logging_steps=4,
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        **{flag: True},
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset["train"], eval_dataset=dataset["validation"])
    trainer.train()
    assert dtypes == {dtype}
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert trainer.model is model  # the unwrapped HF model
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights

    trainer.save_model(str(tmp_path / "final"))
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_text_columns_are_removed_before_the_collator_for_models_whose_forward_takes_kwargs(tmp_path):
    # transformers 5's forward(..., **kwargs): remove_unused_columns keeps its named parameters (HF's rule), so the
    # raw "text" column never reaches DataCollatorWithPadding (which failed on it: "Unable to create tensor")
    words = ["good", "bad", "movie", "plot"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    tok = transformers.BertTokenizerFast(str(tmp_path / "vocab.txt"))
    texts = [" ".join(words[: 1 + i % 4]) for i in range(32)]
    data = datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(32)]})
    data = data.map(lambda b: tok(b["text"]), batched=True)
    config = transformers.BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
    )
    args = TrainingArguments(
        str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=8,
        report_to="none",
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
    )
    trainer = Trainer(
        transformers.BertForSequenceClassification(config),
        args,
        train_dataset=data,
        eval_dataset=data,
        data_collator=transformers.DataCollatorWithPadding(tok),
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and metrics["eval_steps_per_second"] > 0 and metrics["epoch"] > 0  # HF's keys


def test_trainer_and_training_step_signatures_are_hfs():
    # a script passing arguments positionally, or overriding these methods, sees HF's names in HF's order
    import inspect

    for name in ("__init__", "compute_loss", "training_step", "prediction_step", "evaluate", "predict"):
        ours = list(inspect.signature(getattr(Trainer, name)).parameters)
        theirs = list(inspect.signature(getattr(transformers.Trainer, name)).parameters)
        assert ours == theirs[: len(ours)], name


@pytest.mark.parametrize("limit", [None, 1])
def test_patched_evaluate_plants_the_metrics_that_choose_the_best_checkpoint(tmp_path, limit):
    # HF's tests replace Trainer._evaluate (patch.object + evaluate_side_effect_factory) to plant metrics.
    # save_total_limit=1: the newest stays beside the best while the run may resume, and goes when it ends (HF's
    # rule; two folders were left)
    from unittest.mock import patch

    from trainer_utils import make_examples, make_model

    args = TrainingArguments(
        str(tmp_path),
        save_total_limit=limit,
        disable_tqdm=True,
        save_plots=False,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        per_device_train_batch_size=4,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(16), eval_dataset=make_examples(8, seed=1))
    planted = [{"eval_accuracy": a} for a in (0.1, 0.9, 0.5, 0.2)]
    with patch.object(trainer, "_evaluate", side_effect=planted) as evaluate:
        trainer.train()
    assert evaluate.call_count == 4
    assert trainer.state.best_metric == 0.9
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    left = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert left == (["checkpoint-2"] if limit == 1 else [f"checkpoint-{i}" for i in range(1, 5)])


BOTH = [(Trainer, TrainingArguments), (transformers.Trainer, transformers.TrainingArguments)]
"""mixprec's Trainer and HF's, for the tests that run one script under each and compare what they did."""


def side_by_side(folder, run, **fields) -> list:
    """``run(trainer_cls, args)`` under mixprec's Trainer and HF's (one thread's CPU, no saves, no reports), each
    in its own subfolder of ``folder``; what each returned, mixprec's first."""
    quiet = {"save_strategy": "no", "report_to": "none", "disable_tqdm": True, "use_cpu": True}
    return [run(t, a(output_dir=str(folder / t.__module__), **{**quiet, **fields})) for t, a in BOTH]


def test_the_logged_learning_rate_is_the_one_each_step_ran_with_as_hfs(tmp_path):
    # mixprec logged the schedule's next rate (0.000875 at step 1 of a linear decay from 1e-3 over 8 steps)
    def logged(trainer_cls, args):
        trainer = trainer_cls(model=tiny_gpt2(), args=args, train_dataset=lm_split(32, 0))
        trainer.train()
        return [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]

    fields = {"learning_rate": 1e-3, "max_steps": 8, "per_device_train_batch_size": 4, "logging_steps": 1}
    ours, hf = side_by_side(tmp_path, logged, **fields)
    assert hf[0] == 1e-3 and ours == pytest.approx(hf, rel=1e-9)


def test_compute_loss_func_gets_the_windows_label_tokens_and_trains_as_hfs(tmp_path):
    # it was always handed num_items_in_batch=None, so HF's idiom (a summed loss over the window's tokens)
    # raised a TypeError. Padding (-100) differs between the micro-batches of a window: only the window's count
    # weighs every token alike
    import torch.nn.functional as F

    seen = []

    def summed(outputs, labels, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        logits = outputs["logits"][..., :-1, :].float()
        targets = labels[..., 1:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")
        return loss / num_items_in_batch

    def padded(n: int):
        split = lm_split(n, 0)
        rows = [dict(r) for r in split]
        for i, row in enumerate(rows):  # every other row: its second half is padding
            if i % 2:
                row["labels"] = row["labels"][: SEQ // 2] + [-100] * (SEQ - SEQ // 2)
        return datasets.Dataset.from_list(rows)

    def trained(trainer_cls, args):
        model = tiny_gpt2()
        for module in model.modules():  # no dropout: the two runs draw their random numbers differently
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        trainer = trainer_cls(model=model, args=args, train_dataset=padded(12), compute_loss_func=summed)
        trainer.train()
        counted = list(seen)
        seen.clear()
        return [p.detach().clone() for p in trainer.model.parameters()], counted

    fields = {"learning_rate": 1e-2, "max_steps": 3, "per_device_train_batch_size": 2, "logging_steps": 1}
    (ours, counts), (theirs, hf_counts) = side_by_side(
        tmp_path, trained, gradient_accumulation_steps=2, train_sampling_strategy="sequential", **fields
    )
    assert counts and all(c is not None for c in counts)
    assert [int(c) for c in counts] == [int(c) for c in hf_counts]  # the same windows, counted alike
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_every_log_entry_carries_epoch_and_tokens_seen_as_hfs(tmp_path):
    # the evaluation on start had no epoch (mixprec's state.epoch was None before the first step), and only
    # the training-loss entries carried num_input_tokens_seen
    def history(trainer_cls, args):
        trainer = trainer_cls(model=tiny_gpt2(), args=args, train_dataset=lm_split(16, 0), eval_dataset=lm_split(8, 1))
        trainer.train()
        return [(e["step"], e.get("epoch"), e.get("num_input_tokens_seen")) for e in trainer.state.log_history]

    fields = {"max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 2, "eval_steps": 2}
    ours, hf = side_by_side(
        tmp_path, history, eval_strategy="steps", eval_on_start=True, include_num_input_tokens_seen=True, **fields
    )
    assert ours == hf
