"""TrainingArguments' precision, fp16 and bf16: one mode, resolved at construction and again after an edit
(trainer/precision_fields.py). HF scripts set the flags after parsing (``args.fp16 = not args.no_fp16``): that
edit trained in the mode the arguments were built with, while ``args.fp16`` said fp16."""

from __future__ import annotations

import pytest

from conftest import make_tiny_lm
from mixprec import Trainer, TrainingArguments


def edited(**fields) -> TrainingArguments:
    args = TrainingArguments(report_to="none")
    for name, value in fields.items():
        setattr(args, name, value)
    args.validate()  # what the Trainer calls
    return args


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"fp16": True}, ("fp16", True, False)),
        ({"bf16": True}, ("bf16", False, True)),
        ({"precision": "bf16"}, ("bf16", False, True)),
        ({"precision": "bf16:fp32_ops=attention"}, ("bf16:fp32_ops=attention", False, True)),
        ({"precision": "fp16", "fp16": True}, ("fp16", True, False)),
    ],
)
def test_a_field_edited_after_construction_is_the_mode(fields, expected):
    args = edited(**fields)
    assert (args.precision, args.fp16, args.bf16) == expected
    assert args.precision_config.precision == expected[0]


def test_a_flag_turned_off_or_swapped_after_construction_is_seen():
    args = TrainingArguments(bf16=True, report_to="none")
    args.bf16 = False
    args.validate()
    assert (args.precision, args.fp16, args.bf16) == ("fp32", False, False)
    args = TrainingArguments(fp16=True, report_to="none")
    args.fp16, args.bf16 = False, True
    assert args.precision_config.precision == "bf16" and args.bf16 and not args.fp16


def test_edits_that_disagree_are_refused_naming_the_field():
    args = TrainingArguments(report_to="none")
    args.precision, args.bf16 = "fp16", True
    with pytest.raises(ValueError, match=r"TrainingArguments\(precision='fp16'\): .*conflicts with bf16=True"):
        args.validate()


def test_the_trainer_trains_in_the_edited_mode(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, save_plots=False)
    args.fp16 = True
    trainer = Trainer(model=make_tiny_lm(), args=args)
    assert trainer.accelerator.precision.name == "fp16" and args.precision == "fp16"
