"""Callbacks with HF's contract: events, arguments, TrainerControl, and the default flow."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mixprec import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from mixprec.trainer.callbacks import EVENTS, CallbackHandler, DefaultFlowCallback
from trainer_utils import make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def _args(tmp_path, **kwargs) -> TrainingArguments:
    base = {"output_dir": str(tmp_path), "disable_tqdm": True, "save_plots": False, "save_strategy": "no"}
    return TrainingArguments(**{**base, **kwargs})


class Recorder(TrainerCallback):
    """Counts every event and keeps what HF callbacks read."""

    def __init__(self):
        self.events = Counter()
        self.order = []
        self.kwargs = {}

    def __getattribute__(self, name):
        if name in EVENTS:

            def record(args, state, control, **kwargs):
                self.events[name] += 1
                self.order.append(name)
                self.kwargs[name] = {"args": args, "state": state, "control": control, **kwargs}

            return record
        return super().__getattribute__(name)


def test_every_event_fires_with_hf_arguments(tmp_path):
    rec = Recorder()
    # 16 examples / batch 4 = 4 batches per epoch; accumulation 2 -> 2 steps per epoch, 2 epochs
    args = _args(
        tmp_path,
        num_train_epochs=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_steps=1,
    )
    trainer = Trainer(
        make_model(), args, train_dataset=make_examples(16), eval_dataset=make_examples(4, 1), callbacks=[rec]
    )
    trainer.train()
    e = rec.events
    assert (e["on_init_end"], e["on_train_begin"], e["on_train_end"]) == (1, 1, 1)
    assert (e["on_epoch_begin"], e["on_epoch_end"]) == (2, 2)
    assert e["on_step_begin"] == e["on_step_end"] == e["on_optimizer_step"] == e["on_pre_optimizer_step"] == 4
    assert e["on_substep_end"] == 4  # the micro-batches that only accumulate
    assert (e["on_evaluate"], e["on_save"]) == (2, 2)
    assert e["on_log"] == 4 + 2 + 1  # a training entry per step, an evaluation entry per epoch, HF's last one
    assert e["on_prediction_step"] == 2  # one eval batch per evaluation
    step_end = rec.kwargs["on_step_end"]
    assert step_end["args"] is args and isinstance(step_end["state"], TrainerState)
    assert isinstance(step_end["control"], TrainerControl)
    assert step_end["model"] is trainer.model and step_end["optimizer"] is trainer.optimizer
    assert step_end["lr_scheduler"] is trainer.lr_scheduler and step_end["train_dataloader"] is not None
    assert rec.kwargs["on_evaluate"]["metrics"]["eval_loss"] > 0
    assert rec.kwargs["on_log"]["logs"] == {k: v for k, v in trainer.state.log_history[-1].items() if k != "step"}
    assert rec.kwargs["on_save"]["checkpoint"].endswith("checkpoint-4")
    assert "summary" in rec.kwargs["on_train_end"]
    assert rec.order[:3] == ["on_init_end", "on_train_begin", "on_epoch_begin"]
    # HF's order within a step: begin, micro-batch(es), pre-optimizer, optimizer, end
    first = rec.order.index("on_step_begin")
    assert rec.order[first : first + 5] == [
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
    ]


def test_a_callback_can_stop_training_and_request_a_save(tmp_path):
    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True
                control.should_save = True

    trainer = Trainer(make_model(), _args(tmp_path, max_steps=10), train_dataset=make_examples(64), callbacks=[StopAt3])
    assert trainer.train().global_step == 3
    assert (tmp_path / "checkpoint-3").is_dir()


def test_a_callback_returning_a_control_replaces_it(tmp_path):
    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return TrainerControl(should_training_stop=state.global_step >= 2)

    trainer = Trainer(
        make_model(), _args(tmp_path, max_steps=10), train_dataset=make_examples(64), callbacks=[Replace()]
    )
    assert trainer.train().global_step == 2


def test_a_transformers_callback_works_unchanged(tmp_path):
    transformers = pytest.importorskip("transformers")

    class HFCounter(transformers.TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            HFCounter.steps = state.global_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            assert {"loss", "eval_loss", "train_loss"} & set(logs)

    trainer = Trainer(make_model(), _args(tmp_path, max_steps=3, logging_steps=1), train_dataset=make_examples(32))
    trainer.add_callback(HFCounter)
    trainer.train()
    assert HFCounter.steps == 3


def test_a_section_a_callback_adds_to_the_summary_at_train_end_is_written_to_train_summary_json(tmp_path):
    # The precision watch reports this way; the summary writes the file, so events never call back up into it.
    class AddSection(TrainerCallback):
        def on_train_end(self, args, state, control, summary=None, **kwargs):
            summary["my_section"] = {"steps_seen": state.global_step}

    trainer = Trainer(
        make_model(), _args(tmp_path, max_steps=2), train_dataset=make_examples(16), callbacks=[AddSection]
    )
    output = trainer.train()
    written = json.loads((tmp_path / "train_summary.json").read_text())
    assert written["my_section"] == {"steps_seen": 2} == output.metrics["my_section"]
    assert written["global_step"] == 2


def test_handler_add_pop_remove():
    handler = CallbackHandler([DefaultFlowCallback])
    rec = Recorder()
    handler.add_callback(rec)
    assert handler.pop_callback(Recorder) is rec
    handler.add_callback(rec)
    handler.remove_callback(rec)
    assert [type(cb) for cb in handler.callbacks] == [DefaultFlowCallback]
    with pytest.raises(TypeError, match="subclass mixprec.TrainerCallback"):
        handler.add_callback(object())


def test_default_flow_decisions():
    flow = DefaultFlowCallback()
    args = TrainingArguments(
        eval_strategy="steps", eval_steps=4, save_steps=6, logging_steps=2, logging_first_step=True
    )
    state = TrainerState(max_steps=10, logging_steps=2, eval_steps=4, save_steps=6)
    seen = {}
    for step in range(1, 11):
        state.global_step = step
        control = flow.on_step_end(args, state, TrainerControl())
        seen[step] = (control.should_log, control.should_evaluate, control.should_save, control.should_training_stop)
    assert [s for s, c in seen.items() if c[0]] == [1, 2, 4, 6, 8, 10]
    assert [s for s, c in seen.items() if c[1]] == [4, 8, 10]  # and at the end
    assert [s for s, c in seen.items() if c[2]] == [6, 10]  # and at the end
    assert [s for s, c in seen.items() if c[3]] == [10]
    epoch = flow.on_epoch_end(TrainingArguments(eval_strategy="epoch", save_strategy="epoch"), state, TrainerControl())
    assert epoch.should_evaluate and epoch.should_save and not epoch.should_log


# -- stateful callbacks (HF's ExportableState; issue 12 item 4) ------------------------------------------------


def test_callback_states_are_saved_and_restored_on_resume(tmp_path):
    from mixprec import EarlyStoppingCallback, ExportableState

    class StepCounter(TrainerCallback, ExportableState):
        def __init__(self, name="default"):
            self.name, self.steps = name, 0

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1

        def state(self):
            return {"args": {"name": self.name}, "attributes": {"steps": self.steps}}

    def run(callbacks, restore, resume=None):
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            disable_tqdm=True,
            save_plots=False,
            restore_callback_states_from_checkpoint=restore,
        )
        trainer = Trainer(
            make_model(), args, train_dataset=make_examples(16), eval_dataset=make_examples(8), callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run([EarlyStoppingCallback(5, 0.2), StepCounter("a"), StepCounter("b")], restore=False)
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["EarlyStoppingCallback"]["args"] == {"early_stopping_patience": 5, "early_stopping_threshold": 0.2}
    assert [c["attributes"]["steps"] for c in saved["StepCounter"]] == [2, 2]
    assert set(saved["TrainerControl"]["args"]) >= {"should_training_stop", "should_save"}

    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    trainer = run([EarlyStoppingCallback(), StepCounter(), StepCounter()], restore=True, resume=checkpoint)
    names = ("EarlyStoppingCallback", "StepCounter")
    restored = [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ in names]
    early, first, second = restored
    assert (early.early_stopping_patience, early.early_stopping_threshold) == (5, 0.2)
    assert (first.name, second.name) == ("a", "b") and first.steps == 2 + 2  # restored at 2, then 2 more steps
    plain = run([EarlyStoppingCallback()], restore=False, resume=checkpoint)
    early = [cb for cb in plain.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback)][0]
    assert early.early_stopping_patience == 1  # without restore_callback_states_from_checkpoint: as constructed


def test_a_saved_callback_state_with_no_callback_to_take_it_is_a_warning_naming_it(tmp_path):
    from unittest.mock import patch

    from mixprec import EarlyStoppingCallback
    from mixprec.trainer.hf_loggers import hf_logger

    def args(**kwargs):
        return _args(
            tmp_path, max_steps=2, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2, **kwargs
        )

    data = make_examples(16)
    Trainer(
        make_model(),
        args(load_best_model_at_end=True),
        train_dataset=data,
        eval_dataset=data,
        callbacks=[EarlyStoppingCallback()],
    ).train()
    resumed = Trainer(
        make_model(), args(restore_callback_states_from_checkpoint=True), train_dataset=data, eval_dataset=data
    )
    # Where HF's own test looks for it: a patched transformers.trainer logger (mixprec's without transformers).
    with patch.object(hf_logger("trainer"), "warning") as warn:
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert any("EarlyStoppingCallback" in call.args[0] for call in warn.call_args_list)


class MyFlow(DefaultFlowCallback):
    """A script's own flow callback, derived from the default one (HF's remove_callback(class) takes it)."""


def test_pop_and_remove_by_class_take_a_subclass_instance_as_hfs_do(tmp_path):
    trainer = Trainer(make_model(), _args(tmp_path), train_dataset=make_examples(8))
    trainer.pop_callback(DefaultFlowCallback)
    mine = MyFlow()
    trainer.add_callback(mine)
    assert trainer.pop_callback(DefaultFlowCallback) is mine  # HF: isinstance, so the subclass's instance
    trainer.add_callback(mine)
    trainer.remove_callback(DefaultFlowCallback)
    assert not any(isinstance(cb, DefaultFlowCallback) for cb in trainer.callback_handler.callbacks)
    assert trainer.pop_callback(DefaultFlowCallback) is None
