"""transformers' TrainingArguments contract (read from its tests/trainer/test_training_args.py; our own code),
checked against mixprec's TrainingArguments or HF's:

    PYTHONPATH=src:. pytest -q tests/compat/test_hf_training_args.py                           # mixprec
    MIXPREC_COMPAT_IMPL=transformers PYTHONPATH=src:. pytest -q tests/compat/test_hf_training_args.py
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL == "transformers":
    pytest.importorskip("transformers")
    from transformers import TrainingArguments
else:
    from mixprec import TrainingArguments


def hf_internal(what: str):
    return pytest.mark.xfail(IMPL != "transformers", reason=f"HF internal: {what}", strict=True)


def args(**kwargs):
    return TrainingArguments(**{"output_dir": "tmp", "report_to": "none", **kwargs})


def plain(value):
    return getattr(value, "value", value)  # HF's str enums compare as their values


def test_default_output_dir():
    assert TrainingArguments(output_dir=None).output_dir == "trainer_output"


def test_output_dir_is_not_created_by_the_arguments(tmp_path):
    out = tmp_path / "not-yet"
    a = args(output_dir=str(out), do_train=True, save_strategy="no")
    a.save_strategy, a.save_steps = "steps", 1
    assert not out.exists()


def test_output_dir_expands_user():
    assert args(output_dir="~/foo").output_dir == os.path.expanduser("~/foo")


@pytest.mark.parametrize("bad", [1.0, "none", -1, 0])
def test_torch_empty_cache_steps_must_be_a_positive_int(bad):
    assert args(torch_empty_cache_steps=None).torch_empty_cache_steps is None
    assert args(torch_empty_cache_steps=1).torch_empty_cache_steps == 1
    with pytest.raises(ValueError):
        args(torch_empty_cache_steps=bad)


def test_strategy_strings_are_accepted_and_bad_ones_refused():
    a = args(
        eval_strategy="steps",
        eval_steps=10,
        logging_strategy="steps",
        save_strategy="epoch",
        lr_scheduler_type="linear",
        optim="adamw_torch",
    )
    assert (plain(a.eval_strategy), plain(a.save_strategy), plain(a.optim)) == ("steps", "epoch", "adamw_torch")
    with pytest.raises(ValueError):
        args(eval_strategy="invalid_strategy")


@hf_internal("strategies become HF's enum classes (IntervalStrategy, SaveStrategy, ...)")
def test_strategies_become_enums():
    from transformers.trainer_utils import IntervalStrategy

    assert isinstance(args(eval_strategy="steps", eval_steps=10).eval_strategy, IntervalStrategy)


def test_do_eval_follows_the_eval_strategy():
    assert args(do_eval=False, eval_strategy="steps", eval_steps=10).do_eval is True


def test_eval_steps_fall_back_to_logging_steps():
    assert args(eval_strategy="steps", logging_steps=10).eval_steps == 10


def test_eval_steps_needed_when_logging_steps_is_zero():
    with pytest.raises(ValueError):
        args(eval_strategy="steps", logging_steps=0)


def test_logging_steps_must_be_non_zero():
    with pytest.raises(ValueError):
        args(logging_strategy="steps", logging_steps=0)


@pytest.mark.parametrize("name", ["logging_steps", "eval_steps", "save_steps"])
def test_fractional_steps_above_one_are_refused_and_ratios_accepted(name):
    strategy = {"logging_steps": "logging_strategy", "eval_steps": "eval_strategy", "save_steps": "save_strategy"}
    with pytest.raises(ValueError):
        args(**{strategy[name]: "steps", name: 10.5})
    assert getattr(args(**{strategy[name]: "steps", name: 0.5}), name) == 0.5


def test_load_best_model_needs_matching_strategies():
    with pytest.raises(ValueError):
        args(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_strategy="epoch")
    with pytest.raises(ValueError):
        args(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=15)
    assert args(
        load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=20
    ).load_best_model_at_end


@pytest.mark.parametrize(
    "metric, greater", [(None, False), ("eval_loss", False), ("accuracy", True)], ids=["default", "loss", "accuracy"]
)
def test_metric_for_best_model_defaults(metric, greater):
    a = args(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch", metric_for_best_model=metric)
    assert a.metric_for_best_model == (metric or "loss") and a.greater_is_better is greater


def test_fp16_and_bf16_exclude_each_other():
    with pytest.raises(ValueError):
        args(fp16=True, bf16=True)
    with pytest.raises(ValueError):
        args(fp16_full_eval=True, bf16_full_eval=True)


def test_reduce_on_plateau_needs_an_evaluation():
    with pytest.raises(ValueError):
        args(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="no")


def test_torch_compile_is_implied_by_its_mode_or_backend():
    assert args(torch_compile_mode="reduce-overhead").torch_compile
    assert args(torch_compile_backend="inductor").torch_compile
    assert args(torch_compile=True).torch_compile_backend == "inductor"


def test_report_to_none_and_strings():
    assert args(report_to="none").report_to == []
    assert args(report_to=["none"]).report_to == []
    assert args(report_to="tensorboard").report_to == ["tensorboard"]


@hf_internal("the kubeflow reporter (report_to added from KUBEFLOW_TRAINER_SERVER_URL)")
def test_kubeflow_is_added_from_its_environment(monkeypatch):
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://test-url")
    assert "kubeflow" in args(report_to="none").report_to


def test_warmup_steps_validation():
    with pytest.raises(ValueError):
        args(warmup_steps=-1)
    assert args(warmup_steps=0).warmup_steps == 0
    assert args(warmup_steps=0.5).warmup_steps == 0.5  # a ratio in transformers 5


@hf_internal("debug options parse into HF's DebugOption enum (mixprec refuses debug: use `mixprec diagnose`)")
def test_debug_option_parsing():
    from transformers.debug_utils import DebugOption

    assert args(debug="underflow_overflow").debug == [DebugOption.UNDERFLOW_OVERFLOW]


def test_prefetch_factor_needs_workers():
    with pytest.raises(ValueError):
        args(dataloader_prefetch_factor=2, dataloader_num_workers=0)
    assert args(dataloader_prefetch_factor=2, dataloader_num_workers=2).dataloader_prefetch_factor == 2


def test_use_cpu_turns_pin_memory_off():
    assert args(use_cpu=True).dataloader_pin_memory is False


def test_include_num_input_tokens_seen_takes_a_bool():
    assert args(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"
    assert args(include_num_input_tokens_seen=False).include_num_input_tokens_seen == "no"


def test_dict_fields_parse_json_strings():
    a = args(activation_checkpointing=True, activation_checkpointing_kwargs='{"use_reentrant": false}')
    assert a.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_a_subclass_with_a_dtype_field_serialises(tmp_path):
    @dataclasses.dataclass
    class WithDtype(TrainingArguments):
        dtype: torch.dtype = dataclasses.field(default=torch.float32)

    for name in ("float32", "bfloat16", "int64", "bool"):
        a = WithDtype(output_dir=str(tmp_path), report_to="none", dtype=getattr(torch, name))
        assert a.to_dict()["dtype"] == name
        assert json.loads(a.to_json_string())["dtype"] == name
