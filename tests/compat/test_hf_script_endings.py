"""How HF's example scripts (run_clm.py, run_glue.py, run_ner.py...) end, checked against mixprec's Trainer or
HF's: ``log_metrics``, ``save_metrics``, ``save_state``, ``create_model_card``, and the override points
``create_optimizer`` / ``create_scheduler`` (our own code, from reading those scripts and trainer.py):

    PYTHONPATH=src:. pytest -q tests/compat/test_hf_script_endings.py                                   # mixprec
    MIXPREC_COMPAT_IMPL=transformers PYTHONPATH=src:. pytest -q tests/compat/test_hf_script_endings.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL == "transformers":
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments
else:
    from mixprec import Trainer, TrainingArguments


class Regression(torch.utils.data.Dataset):
    def __init__(self, length=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=g)
        self.y = 2.0 * self.x + 3.0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class Line(torch.nn.Module):
    """y = a x + b; the loss only when given labels (a model for compute_loss_func, which takes them away)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


def trainer_for(tmp_path, cls=Trainer, **kwargs):
    extra = {"save_plots": False} if IMPL == "mixprec" else {}
    args = TrainingArguments(
        str(tmp_path / "out"),
        report_to="none",
        disable_tqdm=True,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        **extra,
        **kwargs,
    )
    return cls(Line(), args, train_dataset=Regression(), eval_dataset=Regression(8, 1))


def test_a_run_clm_style_ending_writes_what_the_script_expects(tmp_path, capsys):
    trainer = trainer_for(tmp_path)
    metrics = trainer.train().metrics
    metrics["train_samples"] = len(trainer.train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    ev = trainer.evaluate()
    trainer.log_metrics("eval", ev)
    trainer.save_metrics("eval", ev)
    if IMPL == "mixprec":  # HF's card reads model.config, which only its PreTrainedModels have
        trainer.create_model_card(model_name="tiny-regression", dataset="numbers", tasks="regression")
    out = tmp_path / "out"
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "***** eval metrics *****" in printed
    assert "  train_samples" in printed and "= 0:00:00." in printed  # runtime as h:mm:ss.ss
    # HF's table width: mixprec's sections (the time split, the precision's reason) did not pad every line
    assert max(len(line) for line in printed.splitlines() if " = " in line and "reason" not in line) < 80
    train = json.loads((out / "train_results.json").read_text())
    assert train["train_samples"] == 32 and "train_runtime" in train
    merged = json.loads((out / "all_results.json").read_text())
    assert merged["train_samples"] == 32 and merged["eval_loss"] == pytest.approx(ev["eval_loss"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and any("eval_loss" in e for e in state["log_history"])
    if IMPL == "mixprec":
        card = (out / "README.md").read_text()
        assert "# tiny-regression" in card and "- learning_rate: 5e-05" in card and "| 4 |" in card
    if IMPL == "mixprec":  # transformers 5.25's Trainer.metrics_format is a plain function bound as a method
        formatted = trainer.metrics_format({"train_runtime": 3725.5, "eval_loss": 0.123456789})
        assert formatted == {"train_runtime": "1:02:05.50", "eval_loss": 0.1235}


def test_create_optimizer_and_create_scheduler_are_override_points(tmp_path):
    calls = []

    class Custom(Trainer):
        def create_optimizer(self):
            calls.append("optimizer")
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
            return self.optimizer

        def create_scheduler(self, num_training_steps, optimizer=None):
            calls.append(("scheduler", num_training_steps))
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lambda s: 1.0)
            return self.lr_scheduler

    trainer = trainer_for(tmp_path, cls=Custom, logging_steps=1)
    trainer.train()
    assert calls[0] == "optimizer" and ("scheduler", 4) in calls
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert logged and all(lr == pytest.approx(0.05) for lr in logged)  # the custom optimizer and schedule trained


def test_test_dataloader_and_num_examples(tmp_path):
    trainer = trainer_for(tmp_path, per_device_eval_batch_size=4)
    loader = trainer.get_test_dataloader(Regression(10, 2))
    assert len(loader) == 3 and trainer.num_examples(loader) == 10
    assert trainer.is_local_process_zero() and trainer.is_world_process_zero()


def test_training_step_is_an_override_point_called_per_micro_batch(tmp_path):
    calls = []

    class Counting(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            calls.append(1)
            return super().training_step(model, inputs, num_items_in_batch)

    class Penalised(Trainer):  # backpropagates an extra loss of its own, through the accelerator
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.accelerator.backward(sum(p.pow(2).sum() for p in model.parameters()))
            return loss

    class PenaltyInLoss(Trainer):  # the same penalty inside compute_loss, which training_step divides by 2
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
            loss = loss + 2.0 * sum(p.pow(2).sum() for p in model.parameters())
            return (loss, outputs) if return_outputs else loss

    plain_sgd = {"gradient_accumulation_steps": 2, "learning_rate": 0.02, "optim": "sgd", "max_grad_norm": 0.0}
    counting = trainer_for(tmp_path / "a", cls=Counting, **plain_sgd)
    counting.train()
    assert len(calls) == 8  # 4 steps x 2 micro-batches
    # HF's rule: training_step divides its loss by the accumulation steps; a loss an override backpropagates
    # through accelerator.backward is taken as given (not divided again)
    penalised = trainer_for(tmp_path / "b", cls=Penalised, **plain_sgd)
    penalised.train()
    in_loss = trainer_for(tmp_path / "c", cls=PenaltyInLoss, **plain_sgd)
    in_loss.train()
    for name in ("a", "b"):
        torch.testing.assert_close(getattr(penalised.model, name), getattr(in_loss.model, name))
        assert abs(float(getattr(penalised.model, name))) < abs(float(getattr(counting.model, name)))


def test_prediction_step_is_an_override_point_for_evaluate_and_predict(tmp_path):
    class Doubled(Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            loss = None if loss is None else torch.full_like(loss, 7.0)
            return loss, (None if logits is None else logits * 2), labels

    plain, doubled = trainer_for(tmp_path / "a"), trainer_for(tmp_path / "b", cls=Doubled)
    data = Regression(8, 3)
    assert doubled.evaluate()["eval_loss"] == pytest.approx(7.0)
    expected = plain.predict(data)
    got = doubled.predict(data)
    assert torch.allclose(torch.as_tensor(got.predictions), 2 * torch.as_tensor(expected.predictions))
    assert torch.equal(torch.as_tensor(got.label_ids), torch.as_tensor(expected.label_ids))


def test_compute_loss_func_and_optimizer_cls_and_kwargs(tmp_path):
    seen = []

    def l1(outputs, labels, num_items_in_batch=None):
        seen.append(labels.shape)
        return (outputs[0] - labels).abs().mean()

    extra = {"save_plots": False} if IMPL == "mixprec" else {}
    args = TrainingArguments(
        str(tmp_path / "out"),
        report_to="none",
        disable_tqdm=True,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=8,
        **extra,
    )
    trainer = Trainer(
        Line(),
        args,
        train_dataset=Regression(),
        eval_dataset=Regression(8, 1),
        compute_loss_func=l1,
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}),
    )
    trainer.train()
    assert seen and seen[0] == torch.Size([8])  # the function got the labels; the model did not (no mse)
    assert isinstance(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer, torch.optim.SGD
    )
    first = next(e for e in trainer.state.log_history if "loss" in e)
    data = Regression()
    assert first["loss"] == pytest.approx(float(data.y[:8].abs().mean()), rel=0.5)  # an L1 loss at a = b = 0
    ev = trainer.evaluate()
    assert ev["eval_loss"] > 0  # evaluation's loss is the function's too
    with pytest.raises((ValueError, RuntimeError), match="optimizer"):  # HF: RuntimeError; mixprec: ValueError
        Trainer(
            Line(),
            args,
            train_dataset=Regression(),
            optimizers=(torch.optim.SGD(Line().parameters(), 0.1), None),
            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}),
        )
