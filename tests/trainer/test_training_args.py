"""TrainingArguments: HF's names and defaults, the evaluation_strategy alias, precision as one field, validation
that names the field and the fix, and grouped views that follow later edits."""

from __future__ import annotations

import dataclasses
import enum
import json

import pytest

from mixprec import TrainerState, TrainingArguments

# Fields whose names exist in both classes: the defaults must agree, so a script moving over from
# transformers keeps its behaviour.
SHARED = [
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "warmup_steps",
    "lr_scheduler_type",
    "max_grad_norm",
    "seed",
    "fp16",
    "bf16",
    "dataloader_num_workers",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
    "torch_compile",
    "eval_strategy",
    "eval_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "logging_steps",
    "logging_strategy",
    "logging_first_step",
    "dataloader_drop_last",
    "remove_unused_columns",
    "label_names",
    "disable_tqdm",
    "prediction_loss_only",
    "use_cpu",
    "data_seed",
]


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def test_defaults_match_hugging_face_where_names_overlap(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.TrainingArguments(output_dir=str(tmp_path))
    ours = TrainingArguments(output_dir=str(tmp_path))
    differ = {}
    for name in SHARED:
        theirs, mine = _plain(getattr(hf, name)), getattr(ours, name)
        if name == "eval_steps" and theirs is None:
            theirs = hf.logging_steps  # HF resolves None to logging_steps at use; we resolve it at construction
        if theirs != mine:
            differ[name] = (theirs, mine)
    assert differ == {}
    assert hf.report_to in ([], "none", ["none"]) and ours.report_to == []


def test_the_documented_hf_defaults():
    a = TrainingArguments()
    assert (a.num_train_epochs, a.per_device_train_batch_size, a.learning_rate) == (3.0, 8, 5e-5)
    assert (a.lr_scheduler_type, a.adam_beta1, a.adam_beta2, a.adam_epsilon) == ("linear", 0.9, 0.999, 1e-8)
    assert (a.weight_decay, a.logging_steps, a.save_steps, a.seed) == (0.0, 500, 500, 42)
    assert a.precision == "fp32" and not a.fp16 and not a.bf16


def test_evaluation_strategy_is_accepted_as_the_old_name_of_eval_strategy():
    a = TrainingArguments(output_dir="./results", evaluation_strategy="epoch", fp16=True)
    assert a.eval_strategy == "epoch"
    assert a.evaluation_strategy is None  # one source of truth after construction
    assert TrainingArguments(evaluation_strategy="steps", eval_strategy="steps").eval_strategy == "steps"


def test_conflicting_evaluation_strategy_and_eval_strategy_are_refused():
    with pytest.raises(ValueError, match=r"evaluation_strategy='epoch'.*eval_strategy='steps'"):
        TrainingArguments(evaluation_strategy="epoch", eval_strategy="steps")


@pytest.mark.parametrize(
    ("kwargs", "precision", "fp16", "bf16"),
    [
        ({"fp16": True}, "fp16", True, False),
        ({"bf16": True}, "bf16", False, True),
        ({"precision": "16-mixed"}, "fp16", True, False),
        ({"precision": "bf16", "bf16": True}, "bf16", False, True),
        ({"precision": "no"}, "fp32", False, False),
        ({"precision": "auto"}, "auto", False, False),
    ],
)
def test_precision_is_the_one_field_fp16_and_bf16_resolve_to(kwargs, precision, fp16, bf16):
    a = TrainingArguments(**kwargs)
    assert (a.precision, a.fp16, a.bf16) == (precision, fp16, bf16)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"fp16": True, "bf16": True}, r"bf16=True.*both set"),
        ({"precision": "bf16", "fp16": True}, r"precision='bf16'.*conflicts with fp16=True"),
        ({"precision": "fp17"}, r"TrainingArguments\(precision='fp17'\).*choose one of: no, fp32, fp16, bf16, .*auto"),
        ({"max_steps": -5}, r"max_steps=-5.*-1 to train for num_train_epochs"),
        ({"max_steps": 0}, r"max_steps=0"),
        ({"num_train_epochs": 0}, r"num_train_epochs=0"),
        ({"eval_strategy": "sometimes"}, r"eval_strategy='sometimes'.*'no', 'steps', 'epoch'"),
        ({"save_strategy": "best"}, r"save_strategy='best'"),
        ({"logging_steps": 0}, r"logging_steps=0.*integer >= 1"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0"),
        ({"learning_rate": -1.0}, r"learning_rate=-1.0.*>= 0"),
        ({"adam_beta2": 1.0}, r"adam_beta2=1.0.*\[0, 1\)"),
        ({"warmup_steps": 5, "warmup_ratio": 0.1}, r"warmup_ratio=0.1.*not both"),
        ({"lr_scheduler_type": "cyclic"}, r"lr_scheduler_type='cyclic'.*'linear'"),
        ({"report_to": "comet_ml"}, r"report_to='comet_ml'.*tensorboard, mlflow, wandb.*metrics.jsonl"),
        ({"report_to": ["none", "tensorboard"]}, r"'none' cannot be combined"),
        ({"init_loss_scale": 0.5}, r"init_loss_scale=0.5.*min_loss_scale=1.0"),
        ({"loss_scale_hysteresis": 0}, r"loss_scale_hysteresis=0"),
        ({"max_consecutive_skips": 0}, r"max_consecutive_skips=0"),
        ({"distributed": "horovod"}, r"distributed='horovod'"),
        ({"load_best_model_at_end": True}, r"load_best_model_at_end=True.*eval_strategy"),
        (
            {"load_best_model_at_end": True, "eval_strategy": "epoch", "save_strategy": "steps"},
            r"save_strategy='steps'.*must equal eval_strategy='epoch'",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 30, "save_steps": 50},
            r"save_steps=50.*multiple of eval_steps=30",
        ),
        ({"metric_for_best_model": "accuracy"}, r"metric_for_best_model='accuracy'.*eval_strategy"),
    ],
)
def test_bad_arguments_name_the_field_and_the_fix(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        TrainingArguments(**kwargs)


def test_scaler_knobs_become_grad_scaler_arguments():
    a = TrainingArguments(
        fp16=True,
        init_loss_scale=1024,
        loss_scale_growth_interval=50,
        loss_scale_hysteresis=3,
        min_loss_scale=4,
        max_consecutive_skips=7,
    )
    assert a.precision_config.scaler_kwargs() == {
        "init_scale": 1024.0,
        "growth_interval": 50,
        "hysteresis": 3,
        "min_scale": 4.0,
        "max_consecutive_skips": 7,
    }


def test_grouped_views_follow_later_edits_and_validate_them():
    a = TrainingArguments()
    a.num_train_epochs = 5
    a.learning_rate = 1e-3
    assert a.schedule.num_train_epochs == 5
    assert a.optimization.learning_rate == 1e-3
    a.logging_steps = 0
    with pytest.raises(ValueError, match="logging_steps=0"):
        a.validate()


def test_grouped_views_are_frozen_copies_of_fields_declared_once():
    from dataclasses import FrozenInstanceError

    from mixprec.trainer.configs import ArgsView

    a = TrainingArguments(learning_rate=1e-3)
    opt = a.optimization
    with pytest.raises(FrozenInstanceError, match="set it on the TrainingArguments"):
        opt.learning_rate = 1.0  # code handed a view cannot change the run's arguments
    a.learning_rate = 2e-3
    assert opt.learning_rate == 1e-3 and a.optimization.learning_rate == 2e-3  # a copy taken when read
    # Each grouped field is a TrainingArguments field (one declaration, with its docstring) and in one group only.
    declared = {f.name for f in dataclasses.fields(TrainingArguments)}
    grouped = [name for view in ArgsView.__subclasses__() for name in view.FIELDS]
    assert len(ArgsView.__subclasses__()) == 6 and set(grouped) <= declared and len(grouped) == len(set(grouped))
    assert not any(getattr(view, "__annotations__", {}) for view in ArgsView.__subclasses__())
    with pytest.raises(AttributeError, match="has no field 'seed'"):
        _ = a.optimization.seed


def test_eval_steps_defaults_to_logging_steps_and_warmup_ratio_rounds_up():
    a = TrainingArguments(eval_strategy="steps", logging_steps=7, warmup_ratio=0.1)
    assert a.eval_steps == 7
    assert a.schedule.num_warmup_steps(25) == 3
    assert TrainingArguments(warmup_steps=4).schedule.num_warmup_steps(25) == 4


def test_best_metric_direction_follows_hf():
    ev = TrainingArguments(eval_strategy="epoch", metric_for_best_model="loss").evaluation
    assert ev.metric_key() == "eval_loss" and ev.is_better(0.5, 0.6) and not ev.is_better(0.7, 0.6)
    ev = TrainingArguments(eval_strategy="epoch", metric_for_best_model="accuracy").evaluation
    assert ev.metric_key() == "eval_accuracy" and ev.is_better(0.7, 0.6)


def test_to_dict_is_json_and_round_trips():
    a = TrainingArguments(output_dir="out", fp16=True, evaluation_strategy="epoch", report_to="none")
    text = a.to_json_string()
    back = TrainingArguments.from_dict(json.loads(text))
    assert back == a
    with pytest.raises(ValueError, match="no field"):
        TrainingArguments.from_dict({"output_dir": "x", "not_a_field": 1})


# -- every HF field is accepted (issue 12, item 3) -----------------------------------------------------------


def _hf_fields():
    transformers = pytest.importorskip("transformers")
    import dataclasses

    return {f.name: f for f in dataclasses.fields(transformers.TrainingArguments) if f.init}


def test_every_hf_field_name_is_a_field_here():
    import dataclasses

    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = sorted(set(_hf_fields()) - ours)
    assert missing == []


def test_an_hf_scripts_arguments_construct_unchanged(tmp_path):
    args = TrainingArguments(
        str(tmp_path),  # output_dir stays the first positional argument
        do_train=True,
        do_eval=True,
        eval_strategy="steps",
        eval_steps=0.25,
        logging_steps=0.1,
        save_steps=0.5,
        gradient_checkpointing=True,
        eval_accumulation_steps=4,
        label_smoothing_factor=0.0,
        report_to="none",
        dataloader_pin_memory=True,
        push_to_hub=False,
        hub_model_id="me/model",
        log_level="info",
        ddp_find_unused_parameters=False,
        tf32=None,
        load_best_model_at_end=True,
        save_strategy="steps",
    )
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    state = TrainerState()
    state.compute_steps(args, max_steps=40)  # ratios of the run, rounded up (HF's TrainerState.compute_steps)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (4, 10, 20)
    assert args.ddp_kwargs() == {"find_unused_parameters": False}


@pytest.mark.parametrize(
    "field, value",
    [
        ("label_smoothing_factor", 0.1),
        ("push_to_hub", True),
        ("deepspeed", "ds.json"),
        ("auto_find_batch_size", True),
        ("bf16_full_eval", True),
        ("include_for_metrics", ["inputs"]),
        ("train_sampling_strategy", "group_by_length"),
        ("fsdp", "full_shard offload"),
    ],
)
def test_unimplemented_fields_that_would_change_training_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"TrainingArguments\({field}="):
        TrainingArguments(**{field: value})


def test_every_field_is_documented_as_implemented_ignored_or_refused():
    from mixprec.trainer.hf_fields import POLICY

    ours = set(TrainingArguments.__dataclass_fields__)
    native = ours - set(POLICY)
    assert set(_hf_fields()) <= native | set(POLICY)
    assert {kind for kind, _ in POLICY.values()} == {"implemented", "ignored", "refused"}
    assert all(note for _, note in POLICY.values())


def test_hf_properties(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    a = TrainingArguments(per_device_train_batch_size=4, per_device_eval_batch_size=6, use_cpu=True)
    assert (a.train_batch_size, a.eval_batch_size, a.n_gpu, a.world_size) == (4, 6, 0, 1)
    assert str(a.device) == "cpu" and a.process_index == 0 and a.should_save and a.should_log


def test_load_best_model_at_end_fills_the_metric_as_hf_does():
    a = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")
    assert (a.metric_for_best_model, a.greater_is_better) == ("loss", False)
    b = TrainingArguments(metric_for_best_model="accuracy", eval_strategy="epoch")
    assert b.greater_is_better is True
    transformers = pytest.importorskip("transformers")
    hf = transformers.TrainingArguments(
        "x", load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch", report_to="none"
    )
    assert (hf.metric_for_best_model, hf.greater_is_better) == (a.metric_for_best_model, a.greater_is_better)


@pytest.mark.parametrize("name", ["logging_steps", "eval_steps", "save_steps"])
def test_step_intervals_take_ratios_and_refuse_fractional_counts(name):
    assert getattr(TrainingArguments(**{name: 0.2}), name) == 0.2
    with pytest.raises(ValueError, match=name):
        TrainingArguments(**{name: 2.5})
    with pytest.raises(ValueError, match=name):
        TrainingArguments(**{name: 0})


def test_save_strategy_best_needs_an_evaluation_and_a_metric():
    TrainingArguments(save_strategy="best", eval_strategy="epoch", metric_for_best_model="loss")
    with pytest.raises(ValueError, match="metric_for_best_model"):
        TrainingArguments(save_strategy="best", eval_strategy="epoch")
    with pytest.raises(ValueError, match="save_strategy"):
        TrainingArguments(save_strategy="best", metric_for_best_model="loss")


def test_hf_only_fields_default_as_in_hf(tmp_path):
    from mixprec.trainer.hf_fields import POLICY

    transformers = pytest.importorskip("transformers")
    hf = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    ours = TrainingArguments(output_dir=str(tmp_path))
    differ = {}
    for name in POLICY:
        theirs, mine = _plain(getattr(hf, name)), getattr(ours, name)
        if name == "debug" and theirs == []:
            theirs = ""  # HF parses the string into a list of options
        if name == "accelerator_config":
            continue  # HF resolves None into its own AcceleratorConfig object
        if theirs != mine:
            differ[name] = (theirs, mine)
    assert differ == {}


def test_fields_edited_after_construction_are_still_checked():
    args = TrainingArguments()
    args.push_to_hub = True
    with pytest.raises(ValueError, match="push_to_hub"):
        args.validate()
    args = TrainingArguments()
    args.gradient_checkpointing = True  # the old name, set late, as many scripts do
    assert args.checkpointing_requested() == (True, None)


def test_fsdp_state_dict_type_takes_both_spellings_and_needs_fsdp_for_sharded() -> None:
    args = TrainingArguments(output_dir="unused", distributed="fsdp", fsdp_state_dict_type="SHARDED_STATE_DICT")
    assert args.fsdp_state_dict_type == "sharded"
    with pytest.raises(ValueError, match="fsdp_state_dict_type.*distributed='fsdp'"):
        TrainingArguments(output_dir="unused", fsdp_state_dict_type="sharded")
    with pytest.raises(ValueError, match=r"fsdp_state_dict_type='local'.*'full'.*'sharded'"):
        TrainingArguments(output_dir="unused", distributed="fsdp", fsdp_state_dict_type="local")


def test_async_saves_of_sharded_state_are_refused_when_the_arguments_are_made() -> None:
    """Not at the first save, after the steps before it (the checkpoint writer refuses them there)."""
    with pytest.raises(ValueError, match=r"async_save=True\): is not supported with fsdp_state_dict_type='sharded'"):
        TrainingArguments(output_dir="unused", distributed="fsdp", fsdp_state_dict_type="sharded", async_save=True)


def test_hfs_fsdp_config_sets_the_checkpoint_type_and_refuses_the_rest(tmp_path) -> None:
    args = TrainingArguments(
        output_dir="unused", fsdp="full_shard", fsdp_config={"fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    )
    assert args.distributed == "fsdp" and args.fsdp_state_dict_type == "sharded"
    path = tmp_path / "fsdp.json"
    path.write_text('{"state_dict_type": "FULL_STATE_DICT"}')
    from_file = TrainingArguments(output_dir="unused", fsdp="full_shard", fsdp_config=str(path))
    assert from_file.fsdp_state_dict_type == "full"
    with pytest.raises(ValueError, match="fsdp_config.*transformer_layer_cls_to_wrap is not supported"):
        TrainingArguments(
            output_dir="unused", fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["Block"]}
        )
    with pytest.raises(ValueError, match="fsdp_state_dict_type.*distributed='fsdp'"):
        TrainingArguments(output_dir="unused", fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"})


def test_accelerator_config_sets_the_accelerators_data_loading_and_refuses_the_rest(tmp_path) -> None:
    import torch

    from mixprec import Trainer

    args = TrainingArguments(
        output_dir=str(tmp_path), accelerator_config={"dispatch_batches": False, "non_blocking": True}
    )
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    assert trainer.accelerator.config.non_blocking is True
    with pytest.raises(ValueError, match=r"accelerator_config=.*split_batches=True\) is not supported"):
        TrainingArguments(output_dir=str(tmp_path), accelerator_config={"split_batches": True})
    with pytest.raises(ValueError, match="gradient_accumulation_kwargs is not supported"):
        TrainingArguments(
            output_dir=str(tmp_path), accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}}
        )
    transformers = pytest.importorskip("transformers")
    hf = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none").accelerator_config
    assert TrainingArguments(output_dir=str(tmp_path), accelerator_config=hf).dataloader_configuration() is not None


def test_seq2seq_arguments_add_hfs_generation_fields_and_refuse_bad_values():
    from mixprec import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments("out", predict_with_generate=True, generation_max_length=32, generation_num_beams=2)
    assert args.to_dict()["generation_max_length"] == 32 and args.learning_rate == 5e-5  # a TrainingArguments too
    with pytest.raises(ValueError, match=r"\(sortish_sampler=True\)"):
        Seq2SeqTrainingArguments("out", sortish_sampler=True)
    with pytest.raises(ValueError, match=r"\(generation_num_beams=0\)"):
        Seq2SeqTrainingArguments("out", generation_num_beams=0)


def test_activation_checkpointing_with_a_per_op_policy_is_refused_naming_both_fields(tmp_path):
    # the recompute does not run the policy's fp32 regions: said at construction, not at the first backward
    with pytest.raises(ValueError, match=r"^TrainingArguments\(activation_checkpointing=True\): with precision="):
        TrainingArguments(output_dir=str(tmp_path), precision="bf16", fp32_ops="attention", gradient_checkpointing=True)
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, gradient_checkpointing=True)
    assert args.precision == "bf16"  # the uniform mode trains with it
