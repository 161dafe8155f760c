"""TrainingArguments.precision is a plain ``str`` that HF's parser, a JSON file and a YAML file build alike
(issue 34: its annotation ``str | Precision`` made HfArgumentParser call ``Precision("bf16")`` and crash with
"Invalid device string: 'bf16'"); the registry validates it, and a strategy passed in is kept beside its name."""

from __future__ import annotations

import json

import pytest

from mixprec import TrainingArguments
from mixprec.precision.registry import make_precision

transformers = pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")

# every value `mixprec train --precision` takes: name, canonical name, HF's (fp16, bf16) flags
VALUES = [
    ("fp32", "fp32", (False, False)),
    ("no", "fp32", (False, False)),
    ("fp16", "fp16", (True, False)),
    ("half", "fp16", (True, False)),
    ("bf16", "bf16", (False, True)),
    ("bf16-mixed", "bf16", (False, True)),
    ("bf16-pure", "bf16-pure", (False, False)),
    ("bf16-pure-kahan", "bf16-pure-kahan", (False, False)),
    ("auto", "auto", (False, False)),
    ("bf16:fp32_ops=attention", "bf16:fp32_ops=attention", (False, True)),
]


def _parser():
    return transformers.HfArgumentParser(TrainingArguments)


@pytest.mark.parametrize(("value", "canonical", "flags"), VALUES)
def test_every_precision_parses_from_the_command_line_json_and_yaml(value, canonical, flags, tmp_path):
    out = str(tmp_path / "run")
    (cli,) = _parser().parse_args_into_dataclasses(["--output_dir", out, "--precision", value])
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": out, "precision": value}))
    (from_json,) = _parser().parse_json_file(str(tmp_path / "args.json"))
    (tmp_path / "args.yaml").write_text(yaml.safe_dump({"output_dir": out, "precision": value}))
    (from_yaml,) = _parser().parse_yaml_file(str(tmp_path / "args.yaml"))
    for args in (cli, from_json, from_yaml):
        assert args.precision == canonical
        assert (args.fp16, args.bf16) == flags
        assert args.precision_strategy is None  # a name: the Accelerator parses it for its device


def test_an_unknown_precision_is_refused_by_the_parser_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"TrainingArguments\(precision='fp17'\).*choose one of"):
        _parser().parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--precision", "fp17"])


def test_a_strategy_passed_in_is_kept_beside_its_name_and_the_dict_stays_plain(tmp_path):
    strategy = make_precision("bf16", "cpu")
    args = TrainingArguments(output_dir=str(tmp_path), precision=strategy)
    assert args.precision == "bf16" and args.precision_strategy is strategy and args.bf16
    assert json.loads(args.to_json_string())["precision"] == "bf16"
    again = TrainingArguments.from_dict(args.to_dict())
    assert again.precision == "bf16" and again.precision_strategy is None


@pytest.mark.parametrize(
    ("argv", "field", "expected"),
    [
        (["--gradient_checkpointing"], "activation_checkpointing", True),  # a bare flag, as HF's
        (["--activation_checkpointing"], "activation_checkpointing", True),
        (["--gradient_checkpointing_kwargs", '{"use_reentrant": false}'], "activation_checkpointing_kwargs", {}),
        (["--fsdp"], "distributed", "fsdp"),
    ],
)
def test_hfs_command_line_spellings_parse_as_in_hfs_parser(argv, field, expected):
    # argparse refused them: "expected one argument", "invalid dict value"
    (ours,) = _parser().parse_args_into_dataclasses(["--output_dir", "out", *argv])
    (theirs,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", *argv]
    )
    value = getattr(ours, field)
    assert value == ({"use_reentrant": False} if expected == {} else expected)
    if field != "distributed":
        assert value == getattr(theirs, field)
