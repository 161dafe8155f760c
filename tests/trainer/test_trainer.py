"""The Trainer on CPU: the seed's third snippet verbatim, real fp16/bf16, the model and dataset kinds it takes,
bad input, skipped steps, the consecutive-skip stop, logs, plots and the summary."""

from __future__ import annotations

import json
import logging
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch

from mixprec import ConsecutiveSkipsError, Trainer, TrainerCallback, TrainingArguments
from mixprec.checkpoint.folders import trainer_folders
from trainer_utils import SEQ, VOCAB, accuracy, make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def quiet_args(tmp_path, **kwargs) -> TrainingArguments:
    defaults = {"output_dir": str(tmp_path / "out"), "disable_tqdm": True, "save_plots": False, "save_strategy": "no"}
    return TrainingArguments(**{**defaults, **kwargs})


def linear_output_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, inputs, out: seen.add(out.dtype))
    return seen


def hf_split(examples):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict(
        {"input_ids": [e["input_ids"].tolist() for e in examples], "labels": [e["labels"].tolist() for e in examples]}
    )


# -- the seed's snippet --------------------------------------------------------------------------------


def test_seed_snippet_runs_verbatim_and_trains_in_fp16(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    dataset = datasets.DatasetDict({"train": hf_split(make_examples(48)), "validation": hf_split(make_examples(16, 1))})
    model = make_model()
    compute_metrics = accuracy
    dtypes = linear_output_dtypes(model)

    # --- the seed's third snippet, verbatim ---
    training_args = TrainingArguments(output_dir="./results", evaluation_strategy="epoch", fp16=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["validation"],
        compute_metrics=compute_metrics,
    )

    trainer.train()
    # ---

    assert dtypes == {torch.float16}, "Linear layers must compute in fp16 on the CPU, not silently fp32"
    assert trainer.accelerator.scaler.is_enabled() and trainer.accelerator.mixed_precision == "fp16"
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["epoch"] for e in evals] == [1.0, 2.0, 3.0]  # one evaluation per epoch
    assert all(0.0 <= e["eval_accuracy"] <= 1.0 and math.isfinite(e["eval_loss"]) for e in evals)
    assert trainer.state.global_step == 18  # 3 epochs x 48 / 8
    results = tmp_path / "results"
    assert (results / "metrics.jsonl").is_file()
    for png in ("loss_curves.png", "loss_scale.png"):
        assert (results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((results / "train_summary.json").read_text())
    assert summary["global_step"] == 18 and summary["precision"] == "fp16" and summary["skipped_steps"] == 0
    assert summary["final_loss_scale"] == 65536.0 and summary["train_tokens_per_second"] > 0
    assert summary["peak_memory_bytes"] > 0


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("no", torch.float32)]
)
def test_each_precision_really_runs_and_the_loss_falls(tmp_path, precision, dtype):
    model = make_model(dropout=0.0)
    dtypes = linear_output_dtypes(model)
    args = quiet_args(tmp_path, precision=precision, max_steps=60, learning_rate=3e-2, logging_steps=10)
    trainer = Trainer(model, args, train_dataset=make_examples(128))
    out = trainer.train()
    assert dtypes == {dtype}
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < 0.5 * losses[0], losses
    assert out.global_step == 60 and math.isfinite(out.training_loss)


# -- what the Trainer accepts --------------------------------------------------------------------------


@pytest.mark.parametrize("returns", ["object", "dict", "tuple"])
def test_models_returning_loss_attribute_dict_or_tuple_train(tmp_path, returns):
    trainer = Trainer(make_model(returns=returns), quiet_args(tmp_path, max_steps=3), train_dataset=make_examples(32))
    assert trainer.train().global_step == 3


def test_torch_dataset_of_tuples_and_hf_split_with_extra_columns(tmp_path):
    ids = torch.randint(0, VOCAB, (24, SEQ))
    tensors = torch.utils.data.TensorDataset(ids, (ids + 1) % VOCAB)  # model(*batch)
    Trainer(make_model(), quiet_args(tmp_path, max_steps=2), train_dataset=tensors).train()

    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "label": ((ids + 1) % VOCAB).tolist(),  # HF's singular name: renamed "labels"
            "text": ["a sentence"] * 24,  # a string column: dropped
            "idx": list(range(24)),  # a column forward() does not take: dropped (remove_unused_columns)
        }
    )
    trainer = Trainer(make_model(), quiet_args(tmp_path, max_steps=2, logging_steps=1), train_dataset=split)
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_a_model_that_returns_no_loss_is_a_value_error(tmp_path):
    trainer = Trainer(make_model(returns="none"), quiet_args(tmp_path, max_steps=2), train_dataset=make_examples(16))
    with pytest.raises(ValueError, match=r"without a 'loss' key.*pass labels"):
        trainer.train()


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(make_examples(4))


def test_bad_input_is_refused_with_a_message(tmp_path):
    with pytest.raises(ValueError, match="train_dataset is empty"):
        Trainer(make_model(), quiet_args(tmp_path), train_dataset=[])
    with pytest.raises(ValueError, match="eval_dataset is empty"):
        Trainer(make_model(), quiet_args(tmp_path), train_dataset=make_examples(8), eval_dataset=[])
    with pytest.raises(ValueError, match=r"eval_strategy='epoch'\) needs an eval_dataset"):
        Trainer(make_model(), quiet_args(tmp_path, eval_strategy="epoch"), train_dataset=make_examples(8))
    with pytest.raises(ValueError, match=r"max_steps=-1\): train_dataset is a stream"):
        Trainer(make_model(), quiet_args(tmp_path), train_dataset=Stream()).train()  # HF: streams need max_steps
    with pytest.raises(ValueError, match="model=None"):
        Trainer(None, quiet_args(tmp_path))
    with pytest.raises(ValueError, match="needs a train_dataset"):
        Trainer(make_model(), quiet_args(tmp_path)).train()


# -- evaluation and prediction -------------------------------------------------------------------------


def test_evaluate_and_predict_follow_hf(tmp_path):
    seen = []

    def metrics(eval_pred):
        predictions, label_ids = eval_pred
        seen.append((predictions.shape, label_ids.shape))
        return accuracy(eval_pred)

    trainer = Trainer(make_model(), quiet_args(tmp_path), eval_dataset=make_examples(20, 1), compute_metrics=metrics)
    result = trainer.evaluate()
    assert set(result) >= {"eval_loss", "eval_accuracy", "eval_runtime", "eval_samples_per_second"}
    assert seen == [((20, SEQ, VOCAB), (20, SEQ))]  # every example once, batches concatenated
    assert trainer.state.log_history[-1]["eval_loss"] == result["eval_loss"]
    out = trainer.predict(make_examples(12, 2))
    predictions, label_ids, test_metrics = out
    assert predictions.shape == (12, SEQ, VOCAB) and label_ids.shape == (12, SEQ)
    assert "test_loss" in test_metrics and "test_accuracy" in test_metrics


class WithAux(torch.nn.Module):
    """A model returning a dict with an extra output, as HF models return hidden states or caches."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()

    def forward(self, input_ids, labels=None):
        out = self.inner(input_ids, labels=labels)
        return {"loss": out.loss, "logits": out.logits, "aux": out.logits.mean(-1)}


def test_predict_honours_ignore_keys_and_prediction_loss_only_as_hf(tmp_path):
    # ignore_keys was accepted and dropped, and predict() returned predictions and ran compute_metrics under
    # prediction_loss_only=True (HF returns the loss alone)
    called = []

    def metrics(eval_pred):
        called.append(1)
        return {}

    trainer = Trainer(WithAux(), quiet_args(tmp_path), compute_metrics=metrics)
    both = trainer.predict(make_examples(4, 2)).predictions
    assert isinstance(both, tuple) and [p.shape for p in both] == [(4, SEQ, VOCAB), (4, SEQ)]
    assert trainer.predict(make_examples(4, 2), ignore_keys=["aux"]).predictions.shape == (4, SEQ, VOCAB)
    evaluated = trainer.evaluate(make_examples(4, 2), ignore_keys=["aux"])
    assert "eval_loss" in evaluated
    trainer.args.prediction_loss_only = True
    called.clear()
    out = trainer.predict(make_examples(4, 2))
    assert out.predictions is None and out.label_ids is None and "test_loss" in out.metrics and not called


def test_eval_loss_is_the_mean_over_examples(tmp_path):
    model = make_model(dropout=0.0)
    examples = make_examples(20, 1)  # batches of 8, 8, 4: a mean of batch means would weigh the 4 wrong
    trainer = Trainer(model, quiet_args(tmp_path), eval_dataset=examples)
    with torch.no_grad():
        expected = torch.stack([model(e["input_ids"][None], labels=e["labels"][None]).loss for e in examples]).mean()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)


# -- loss scaling in training --------------------------------------------------------------------------


class LR(TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.lrs.append(lr_scheduler.get_last_lr()[0])


def poison(param: torch.nn.Parameter, calls: set[int] | None) -> None:
    """Make ``param``'s gradient inf on the given backward calls (1-based; None: every call)."""
    count = [0]

    def hook(grad):
        count[0] += 1
        return grad * float("inf") if calls is None or count[0] in calls else grad

    param.register_hook(hook)


def test_a_skipped_step_holds_the_lr_and_logs_the_nonfinite_parameters(tmp_path, caplog):
    model = make_model(dropout=0.0)
    poison(model.head.weight, {3})
    lr = LR()
    args = quiet_args(tmp_path, fp16=True, max_steps=6, logging_steps=1, learning_rate=1e-2)
    trainer = Trainer(model, args, train_dataset=make_examples(64), callbacks=[lr])
    with caplog.at_level(logging.WARNING, logger="mixprec.trainer"):
        trainer.train()
    base = 1e-2
    assert lr.lrs == pytest.approx([base * k / 6 for k in (5, 4, 4, 3, 2, 1)])  # step 3 did not advance it
    assert trainer.skipped_steps == 1
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["loss_scale"] for e in logs] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 32768.0]
    assert any("step 3" in r.message and "head.weight" in r.message for r in caplog.records)
    events = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    skips = [e for e in events if e.get("event") == "skipped_step"]
    assert skips == [
        {**skips[0], "step": 3, "loss_scale": 65536.0, "nonfinite_grads": ["head.weight"]}
    ]  # only the poisoned parameter, named as in model.named_parameters()
    assert [(e["step"], e["scale"]) for e in events if e.get("event") == "loss_scale"] == [(0, 65536.0), (3, 32768.0)]


def test_consecutive_skips_beyond_the_limit_stop_with_the_layer_named(tmp_path):
    model = make_model(dropout=0.0)
    poison(model.hidden.weight, None)
    args = quiet_args(tmp_path, fp16=True, max_steps=10, max_consecutive_skips=3, save_strategy="steps", save_steps=1)
    trainer = Trainer(model, args, train_dataset=make_examples(64))
    with pytest.raises(ConsecutiveSkipsError, match=r"Trainer stopped at step 3.*hidden\.weight.*checkpoint-2"):
        trainer.train()
    saved = trainer_folders(tmp_path / "out").complete()
    assert [p.name for p in saved] == ["checkpoint-1", "checkpoint-2"]  # nothing written for the failed state
    assert all(trainer_folders(tmp_path / "out").is_complete(p) for p in saved)
    assert not list((tmp_path / "out").glob(".checkpoint-3*"))


def test_scaler_knobs_reach_the_scaler(tmp_path):
    args = quiet_args(
        tmp_path, fp16=True, init_loss_scale=256, loss_scale_growth_interval=2, max_steps=4, logging_steps=1
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(64))
    trainer.train()
    assert [e["loss_scale"] for e in trainer.state.log_history if "loss" in e] == [256.0, 512.0, 512.0, 1024.0]


def test_diagnose_at_start_starts_the_scaler_at_the_recommended_scale(tmp_path):
    pytest.importorskip("mixprec.diagnostics.diagnose")
    args = quiet_args(tmp_path, fp16=True, diagnose_at_start=True, max_steps=2, max_consecutive_skips=None)
    trainer = Trainer(make_model(), args, train_dataset=make_examples(32))
    trainer.train()
    recommended = trainer.diagnosis.recommended_init_scale
    expected = min(max(recommended, 1.0), 2.0**24)
    events = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e.get("event") == "loss_scale"][0]["scale"] == expected
    diagnosis = [e for e in events if e.get("event") == "diagnosis"]
    assert diagnosis[0]["report"]["recommended_init_scale"] == recommended


# -- gradient accumulation and the progress bar --------------------------------------------------------


def test_gradient_accumulation_steps_on_the_last_batch_of_each_epoch(tmp_path):
    # 5 batches per epoch with accumulation 2: steps after batches 2, 4 and 5 -> 3 steps per epoch
    args = quiet_args(tmp_path, gradient_accumulation_steps=2, num_train_epochs=2, per_device_train_batch_size=4)
    trainer = Trainer(make_model(), args, train_dataset=make_examples(20))
    assert trainer.train().global_step == 6
    assert trainer.state.epoch == 2.0


def test_progress_bar_shows_loss_lr_scale_and_throughput(tmp_path):
    trainer = Trainer(make_model(), quiet_args(tmp_path, fp16=True, max_steps=2), train_dataset=make_examples(16))
    trainer.train()
    trainer.meter.add(torch.tensor(2.0), samples=8, tokens=64)
    shown = trainer.meter.postfix()
    assert set(shown) == {"loss", "lr", "scale", "tok/s"} and shown["scale"] == "65536"


def test_the_last_progress_line_shows_what_metrics_jsonl_logged_at_the_last_step(tmp_path, capsys, monkeypatch):
    """Issue 34: the bar refreshes its loss and lr at most once a second, so a short run ended on a line of
    values from an earlier step (loss=15.68, lr=4.59e-01 at 80/80 where metrics.jsonl had 3.28 and lr 0.0)."""
    from mixprec.trainer.callbacks import TrainerCallback
    from mixprec.trainer.events import ProgressCallback
    from mixprec.trainer.logging import read_metrics

    class SlowRefresh(TrainerCallback):  # the bar refreshes at step 1 only, as on a run of ~1 s steps
        def on_step_end(self, args, state, control, **kwargs):
            trainer.events.progress.refresh_seconds = 3600.0

    monkeypatch.setattr(ProgressCallback, "refresh_seconds", 0.0)
    args = quiet_args(
        tmp_path,
        disable_tqdm=False,
        max_steps=6,
        logging_steps=3,
        learning_rate=0.5,
        lr_scheduler_type="linear",
        report_to="none",
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(48), callbacks=[SlowRefresh()])
    trainer.train()
    last = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train: 6/6 steps")][-1]
    logged = [e for e in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in e][-1]
    assert logged["step"] == 6
    assert f"loss={logged['loss']:.4f}" in last and f"lr={logged['learning_rate']:.2e}" in last, last


def test_metrics_jsonl_keeps_earlier_runs_and_reads_the_latest(tmp_path):
    from mixprec.trainer.logging import read_metrics

    args = quiet_args(tmp_path, max_steps=3, logging_steps=1)
    Trainer(make_model(), args, train_dataset=make_examples(16)).train()
    Trainer(
        make_model(seed=1), quiet_args(tmp_path, max_steps=2, logging_steps=1), train_dataset=make_examples(16)
    ).train()
    path = tmp_path / "out" / "metrics.jsonl"
    assert [e["step"] for e in read_metrics(path, current_run=False) if "loss" in e] == [1, 2, 3, 1, 2]
    assert [e["step"] for e in read_metrics(path) if "loss" in e] == [1, 2]


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import mixprec.trainer.logging as trainer_logging

    monkeypatch.setattr(trainer_logging, "tensorboard_available", lambda: False)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        Trainer(make_model(), quiet_args(tmp_path, report_to="tensorboard"), train_dataset=make_examples(8))


def test_tensorboard_gets_the_loss_the_loss_scale_and_eval_scalars(tmp_path):
    pytest.importorskip("tensorboard")  # a test extra: installed in CI
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = quiet_args(
        tmp_path,
        report_to="tensorboard",
        logging_steps=1,
        eval_strategy="epoch",
        num_train_epochs=1,
        per_device_train_batch_size=4,
        fp16=True,
    )
    Trainer(make_model(), args, train_dataset=make_examples(8), eval_dataset=make_examples(4)).train()
    events = EventAccumulator(args.logging_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss"} <= tags, tags
    assert any("scale" in tag for tag in tags), tags  # what the precision did is visible there too
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_the_example_runs(tmp_path, monkeypatch):
    example = Path(__file__).resolve().parents[2] / "examples" / "trainer_snippet.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [example.name, "--corpus-bytes", "2000", "--seq-len", "32"])
    runpy.run_path(str(example), run_name="__main__")
    entries = [json.loads(line) for line in (tmp_path / "results" / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in entries if "eval_next_byte_accuracy" in e] == [1.0, 2.0, 3.0]


# -- evaluation uses training's model call and compute_loss (issue 12, bug 5) ----------------------------


class TupleLM(torch.nn.Module):
    """A model for a TensorDataset: ``forward(x, y)`` positionally, returning ``(loss, logits)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        out = self.net(x)
        return torch.nn.functional.mse_loss(out, y), out


def tensor_pairs(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True))


def test_evaluate_on_a_tensor_dataset_calls_the_model_as_training_does(tmp_path):
    data = tensor_pairs()
    trainer = Trainer(TupleLM(), quiet_args(tmp_path, max_steps=3), train_dataset=data, eval_dataset=data)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert math.isfinite(before) and after < before


class SquaredErrorTrainer(Trainer):
    """A compute_loss override (HF's documented way to customise the loss) on a model that returns a tensor."""

    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        type(self).calls += 1
        x, y = inputs
        out = model(x)
        loss = ((out - y) ** 2).sum(-1).mean() * 10.0  # not what the model would compute: an override shows
        return (loss, out) if return_outputs else loss


def test_evaluate_honours_a_compute_loss_override(tmp_path):
    data = tensor_pairs(16)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    trainer = SquaredErrorTrainer(
        model, quiet_args(tmp_path, max_steps=2, per_device_eval_batch_size=16), train_dataset=data, eval_dataset=data
    )
    x, y = data.tensors
    with torch.no_grad():
        expected = (((model(x) - y) ** 2).sum(-1).mean() * 10.0).item()
    SquaredErrorTrainer.calls = 0
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert SquaredErrorTrainer.calls == 1
    trainer.train()
    assert SquaredErrorTrainer.calls == 3


# -- SIGTERM ---------------------------------------------------------------------------------------------


class SigtermAfterStep(TrainerCallback):
    """Sends this process SIGTERM at the end of step ``step``, as a scheduler preempting the job would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            import os
            import signal

            # only while train() handles SIGTERM: the default action would end the test process
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_then_raises_training_interrupted_not_system_exit(tmp_path):
    import signal

    from mixprec import TrainingInterrupted

    args = quiet_args(tmp_path, max_steps=6, per_device_train_batch_size=4, logging_steps=1)
    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(make_model(), args, train_dataset=make_examples(24), callbacks=[SigtermAfterStep(2)])
    try:
        trainer.train()
    except SystemExit as exit_:  # a library never ends its caller's process
        pytest.fail(f"train() raised SystemExit({exit_.code}) on SIGTERM")
    except TrainingInterrupted as stop:
        assert (stop.signum, stop.exit_status, stop.step) == (signal.SIGTERM, 143, 2)
        assert stop.checkpoint == str(tmp_path / "out" / "checkpoint-2")
        assert trainer_folders(tmp_path / "out").is_complete(stop.checkpoint)
        assert "trainer.train(resume_from_checkpoint=True)" in str(stop)
    else:
        pytest.fail("train() returned as if the run had finished")
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back
    assert trainer.state.global_step == 2
    resumed = Trainer(make_model(), args, train_dataset=make_examples(24))
    assert resumed.train(resume_from_checkpoint=True).global_step == 6


def test_a_log_override_sees_the_training_logs_and_the_summary(tmp_path):
    seen = []

    class Recording(Trainer):
        def log(self, logs):  # HF users override log to add or route metrics
            seen.append(dict(logs))
            super().log(logs)

    args = quiet_args(tmp_path, max_steps=3, per_device_train_batch_size=4, logging_steps=1)
    trainer = Recording(make_model(), args, train_dataset=make_examples(12))
    trainer.train()
    history = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert [e["loss"] for e in seen if "loss" in e] == history and len(history) == 3
    assert "train_runtime" in seen[-1]
