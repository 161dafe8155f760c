"""transformers' Trainer callback contract (read from its tests/trainer/test_trainer_callback.py and the
early-stopping tests of test_trainer.py; our own code), checked against mixprec's Trainer or HF's:

    PYTHONPATH=src:. pytest -q tests/compat/test_hf_trainer_callbacks.py                           # mixprec
    MIXPREC_COMPAT_IMPL=transformers PYTHONPATH=src:. pytest -q tests/compat/test_hf_trainer_callbacks.py

Checks that name HF-internal classes (``DEFAULT_CALLBACKS``, ``PrinterCallback``, ``Trainer._load_callback_state``,
the module logger patched by name) pass under mixprec too: it provides each of them.
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL == "transformers":
    transformers = pytest.importorskip("transformers")
    from transformers import (
        DefaultFlowCallback,
        EarlyStoppingCallback,
        PrinterCallback,
        ProgressCallback,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.trainer_callback import ExportableState
else:
    from mixprec import (
        DefaultFlowCallback,
        EarlyStoppingCallback,
        ExportableState,
        PrinterCallback,
        ProgressCallback,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


# -- a regression task: y = 2x + 3 + noise, model y = a x + b ---------------------------------------------------


class Regression(torch.utils.data.Dataset):
    def __init__(self, length=64, seed=42):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=g)
        self.y = 2.0 * self.x + 3.0 + 0.1 * torch.randn(length, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModel(torch.nn.Module):
    def __init__(self, a=0.0, b=0.0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(float(a)))
        self.b = torch.nn.Parameter(torch.tensor(float(b)))

    def forward(self, input_x, labels=None):
        y = self.a * input_x + self.b
        if labels is None:
            return {"logits": y}
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


class Recorder(TrainerCallback):
    """Registers every event it sees."""

    def __init__(self, my_test_state="test"):
        self.events = []
        self.my_test_state = my_test_state

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kw: self.events.append(name)
        return super().__getattribute__(name)


class Exportable(TrainerCallback, ExportableState):
    def __init__(self, my_test_state="test"):
        self.my_test_state = my_test_state

    def state(self):
        return {"args": {"my_test_state": self.my_test_state}, "attributes": {}}


def get_trainer(tmp_path, callbacks=None, train_len=64, eval_len=64, **kwargs):
    extra = {"save_plots": False} if IMPL == "mixprec" else {}
    kwargs.setdefault("disable_tqdm", True)
    args = TrainingArguments(str(tmp_path / "out"), report_to=[], **extra, **kwargs)
    return Trainer(
        RegressionModel(),
        args,
        train_dataset=Regression(train_len),
        eval_dataset=Regression(eval_len),
        callbacks=callbacks,
    )


def recorder(trainer):
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Recorder))


def expected_events(trainer):
    """HF's documented order: init, train begin; per epoch: begin, per step (begin, pre-optimizer, optimizer,
    end, then log / evaluate / save as configured), end (+ epoch evaluation); a final log and train end."""
    args, state = trainer.args, trainer.state
    eval_batches = len(trainer.get_eval_dataloader())
    evaluation = ["on_prediction_step"] * eval_batches + ["on_log", "on_evaluate"]
    events, step = ["on_init_end", "on_train_begin"], 0
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    for _ in range(int(state.num_train_epochs)):
        events.append("on_epoch_begin")
        for _ in range(len(trainer.get_train_dataloader())):
            step += 1
            events += ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
            if step % args.logging_steps == 0:
                events.append("on_log")
            if strategy == "steps" and (step % args.eval_steps == 0 or step == state.max_steps):
                events += evaluation  # transformers 5: also at the last step, once
            if step % args.save_steps == 0 or step == state.max_steps:
                events.append("on_save")
        events.append("on_epoch_end")
        if strategy == "epoch":
            events += evaluation
    return events + ["on_log", "on_train_end"]


# -- which callbacks a Trainer has -----------------------------------------------------------------------------


def test_callbacks_passed_at_init_join_the_default_flow(tmp_path):
    trainer = get_trainer(tmp_path)
    assert any(isinstance(cb, DefaultFlowCallback) for cb in trainer.callback_handler.callbacks)
    with_recorder = get_trainer(tmp_path, callbacks=[Recorder])  # a class is instantiated
    extra = [cb for cb in with_recorder.callback_handler.callbacks if isinstance(cb, Recorder)]
    assert (
        len(extra) == 1 and len(with_recorder.callback_handler.callbacks) == len(trainer.callback_handler.callbacks) + 1
    )


def _names(trainer):
    return sorted(type(cb).__name__ for cb in trainer.callback_handler.callbacks)


def test_default_callbacks_are_hfs_list(tmp_path, capsys):
    # the default flow, then the bar, or with disable_tqdm the printer, then the user's (report_to="none")
    assert _names(get_trainer(tmp_path, disable_tqdm=False)) == ["DefaultFlowCallback", "ProgressCallback"]
    printing = get_trainer(tmp_path, disable_tqdm=True)
    assert _names(printing) == ["DefaultFlowCallback", "PrinterCallback"]
    assert any(isinstance(cb, PrinterCallback) for cb in printing.callback_handler.callbacks)
    with_recorder = get_trainer(tmp_path, callbacks=[Recorder], disable_tqdm=False)
    assert _names(with_recorder) == ["DefaultFlowCallback", "ProgressCallback", "Recorder"]
    assert any(isinstance(cb, ProgressCallback) for cb in with_recorder.callback_handler.callbacks)
    # the printer prints each log entry
    printing = get_trainer(tmp_path, disable_tqdm=True, logging_steps=4)
    capsys.readouterr()
    printing.train()
    printed = capsys.readouterr().out
    assert "'loss'" in printed and "'train_runtime'" in printed


def test_removing_every_callback_keeps_the_run_record(tmp_path):
    # metrics.jsonl is the run's record, not a callback: a script that clears the list still gets it (mixprec)
    if IMPL == "transformers":
        pytest.skip("metrics.jsonl is mixprec's")
    trainer = get_trainer(tmp_path, logging_steps=1)
    for cb in list(trainer.callback_handler.callbacks):
        if not isinstance(cb, DefaultFlowCallback):  # the flow decides when to log
            trainer.remove_callback(cb)
    trainer.train()
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == trainer.state.global_step


def test_handler_has_a_method_per_event(tmp_path):
    trainer = get_trainer(tmp_path, callbacks=[Recorder], max_steps=1)
    trainer.train()
    seen = recorder(trainer)
    before = len(seen.events)
    trainer.callback_handler.on_push_begin(trainer.args, trainer.state, trainer.control)
    assert seen.events[before:] == ["on_push_begin"]


def test_control_resets_by_hfs_names():
    control = TrainerControl(should_training_stop=True, should_epoch_stop=True, should_save=True, should_log=True)
    control._new_step()
    assert not (control.should_save or control.should_log or control.should_evaluate)
    control._new_epoch()
    assert not control.should_epoch_stop and control.should_training_stop
    control._new_training()
    assert not control.should_training_stop


def test_state_compute_steps():
    class Ratios:
        logging_steps, eval_steps, save_steps = 0.1, 0.25, 0.5

    class Counts:
        logging_steps, eval_steps, save_steps = 10, 20, 50

    for args, expected in ((Ratios(), (10, 25, 50)), (Counts(), (10, 20, 50))):
        state = TrainerState()
        state.compute_steps(args, max_steps=100)
        assert (state.logging_steps, state.eval_steps, state.save_steps) == expected
    state = TrainerState()
    state.compute_steps(Ratios(), max_steps=7)  # rounded up
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (1, 2, 4)


def test_add_pop_remove_by_class(tmp_path):
    trainer = get_trainer(tmp_path)
    n = len(trainer.callback_handler.callbacks)
    trainer.remove_callback(DefaultFlowCallback)
    assert len(trainer.callback_handler.callbacks) == n - 1
    trainer = get_trainer(tmp_path)
    cb = trainer.pop_callback(DefaultFlowCallback)
    assert type(cb) is DefaultFlowCallback and len(trainer.callback_handler.callbacks) == n - 1
    trainer.add_callback(DefaultFlowCallback)
    assert len(trainer.callback_handler.callbacks) == n


def test_add_pop_remove_by_instance(tmp_path):
    trainer = get_trainer(tmp_path)
    n = len(trainer.callback_handler.callbacks)
    first = trainer.callback_handler.callbacks[0]
    trainer.remove_callback(first)
    assert first not in trainer.callback_handler.callbacks and len(trainer.callback_handler.callbacks) == n - 1
    trainer = get_trainer(tmp_path)
    first = trainer.callback_handler.callbacks[0]
    assert trainer.pop_callback(first) is first
    trainer.add_callback(first)
    assert first in trainer.callback_handler.callbacks


def test_adding_a_second_callback_of_one_class_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        get_trainer(tmp_path, callbacks=[Recorder, Recorder])
    assert any("Recorder" in r.getMessage() for r in caplog.records)


# -- the order of events ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"logging_steps": 5},
        {"save_steps": 5},
        {"eval_steps": 5, "eval_strategy": "steps"},
        {"eval_strategy": "epoch"},
        {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
    ],
    ids=["defaults", "log5", "save5", "eval5", "eval-epoch", "mixed"],
)
def test_event_flow(tmp_path, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = get_trainer(tmp_path, callbacks=[Recorder], **kwargs)
        trainer.train()
    assert recorder(trainer).events == expected_events(trainer)


# -- callbacks whose state goes into checkpoints ---------------------------------------------------------------

STATEFUL = dict(
    load_best_model_at_end=True, save_strategy="steps", eval_strategy="steps", save_steps=2, eval_steps=2, max_steps=2
)


def test_stateful_callbacks(tmp_path):
    get_trainer(tmp_path, callbacks=[EarlyStoppingCallback(5, 0.2)], **STATEFUL).train()
    trainer = get_trainer(
        tmp_path, callbacks=[EarlyStoppingCallback()], restore_callback_states_from_checkpoint=True, **STATEFUL
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
    assert (cb.early_stopping_patience, cb.early_stopping_threshold) == (5, 0.2)


def test_stateful_mixed_callbacks(tmp_path):
    get_trainer(tmp_path, callbacks=[Recorder("another value"), EarlyStoppingCallback(5, 0.2)], **STATEFUL).train()
    trainer = get_trainer(
        tmp_path,
        callbacks=[EarlyStoppingCallback(), Recorder()],
        restore_callback_states_from_checkpoint=True,
        **STATEFUL,
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    early = next(c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
    assert (early.early_stopping_patience, early.early_stopping_threshold) == (5, 0.2)
    assert recorder(trainer).my_test_state == "test"  # not stateful: left as constructed


def test_stateful_duplicate_callbacks(tmp_path):
    get_trainer(tmp_path, callbacks=[Exportable("first"), Exportable("second")], **STATEFUL).train()
    fresh = [Exportable(), Exportable()]
    trainer = get_trainer(tmp_path, callbacks=fresh, restore_callback_states_from_checkpoint=True, **STATEFUL)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    states = [c.my_test_state for c in trainer.callback_handler.callbacks if isinstance(c, Exportable)]
    assert states == ["first", "second"]


def test_missing_stateful_callback_warns(tmp_path, caplog):
    get_trainer(tmp_path, callbacks=[EarlyStoppingCallback()], **STATEFUL).train()
    trainer = get_trainer(
        tmp_path,
        save_strategy="steps",
        eval_strategy="steps",
        save_steps=2,
        eval_steps=2,
        max_steps=2,
        restore_callback_states_from_checkpoint=True,
    )
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert any("EarlyStoppingCallback" in r.getMessage() for r in caplog.records)


def test_stateful_control(tmp_path):
    get_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2).train()
    trainer = get_trainer(tmp_path, max_steps=2, restore_callback_states_from_checkpoint=True)
    trainer.state = TrainerState.load_from_json(str(tmp_path / "out" / "checkpoint-2" / "trainer_state.json"))
    trainer._load_callback_state()
    assert trainer.control.should_training_stop


def test_control_state_is_saved(tmp_path):
    get_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2).train()
    state = TrainerState.load_from_json(str(tmp_path / "out" / "checkpoint-2" / "trainer_state.json"))
    assert state.stateful_callbacks["TrainerControl"]["args"]["should_training_stop"] is True


# -- early stopping (test_trainer.py) ---------------------------------------------------------------------------


def test_early_stopping_callback(tmp_path):
    # patience 1, threshold 0.0001: the loss of this task falls slowly, so training stops before max_steps
    trainer = get_trainer(
        tmp_path,
        callbacks=[EarlyStoppingCallback(1, 0.0001)],
        num_train_epochs=20,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        learning_rate=1e-5,
    )
    trainer.train()
    assert trainer.state.global_step < trainer.state.max_steps


def test_early_stopping_needs_a_metric(tmp_path):
    trainer = get_trainer(tmp_path, callbacks=[EarlyStoppingCallback(1)], num_train_epochs=1)
    with pytest.raises((AssertionError, ValueError)):  # HF asserts, mixprec raises a ValueError naming the field
        trainer.train()


def test_early_stopping_patience_counts_evaluations_without_improvement(tmp_path):
    cb = EarlyStoppingCallback(early_stopping_patience=2)
    trainer = get_trainer(
        tmp_path,
        callbacks=[cb],
        eval_strategy="steps",
        eval_steps=1,
        max_steps=10,
        metric_for_best_model="loss",
        save_strategy="no",
    )
    trainer.state.best_metric = 0.5
    for value in (0.6, 0.7):
        cb.on_evaluate(trainer.args, trainer.state, trainer.control, metrics={"eval_loss": value})
    assert cb.early_stopping_patience_counter == 2 and trainer.control.should_training_stop
