"""Our dataclasses parse as HF's example scripts parse theirs (issue 22): run_clm.py's
``HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))`` from argv and from a JSON file,
a plain argparse helper built from the fields' metadata, and ``to_dict``/``to_json_string`` round trips."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import pytest

import mixprec
from mixprec import Seq2SeqTrainingArguments, TrainingArguments

transformers = pytest.importorskip("transformers")


@dataclasses.dataclass
class ModelArguments:  # the shape of run_clm.py's
    model_name_or_path: str | None = dataclasses.field(default=None, metadata={"help": "checkpoint"})
    dtype: str | None = dataclasses.field(default=None, metadata={"choices": ["auto", "bfloat16", "float16"]})


@dataclasses.dataclass
class DataTrainingArguments:
    dataset_name: str | None = None
    block_size: int | None = None


ARGV = [
    "--model_name_or_path",
    "tiny",
    "--block_size",
    "16",
    "--output_dir",
    "OUT",
    "--do_train",
    "--bf16",
    "--per_device_train_batch_size",
    "3",
    "--gradient_accumulation_steps",
    "2",
    "--max_steps",
    "5",
    "--lr_scheduler_type",
    "cosine",
    "--save_steps",
    "500",
    "--logging_steps",
    "0.1",
    "--warmup_steps",
    "2",
    "--report_to",
    "none",
    "--ddp_find_unused_parameters",
    "false",
    "--seed",
    "7",
]


@pytest.mark.parametrize("cls", [TrainingArguments, Seq2SeqTrainingArguments])
def test_run_clm_parses_argv_and_its_json_round_trip(cls, tmp_path):
    parser = transformers.HfArgumentParser((ModelArguments, DataTrainingArguments, cls))
    argv = [str(tmp_path) if a == "OUT" else a for a in ARGV]
    model_args, data_args, args = parser.parse_args_into_dataclasses(argv)
    assert isinstance(args, cls)
    assert (model_args.model_name_or_path, data_args.block_size) == ("tiny", 16)
    assert args.precision == "bf16" and args.do_train and args.per_device_train_batch_size == 3
    assert (args.max_steps, args.lr_scheduler_type, args.seed) == (5, "cosine", 7)
    # Whole-number steps are ints, as HF stores them; a float below 1 stays a ratio.
    assert args.save_steps == 500 and isinstance(args.save_steps, int) and args.logging_steps == 0.1
    assert args.ddp_find_unused_parameters is False and args.report_to == []

    # run_clm.py's other entry: one JSON file holding every group's fields.
    as_dict = args.to_dict()
    assert json.loads(args.to_json_string()) == json.loads(json.dumps(as_dict))
    config = tmp_path / "args.json"
    config.write_text(json.dumps({**as_dict, "model_name_or_path": "tiny", "block_size": 16}))
    _, _, again = parser.parse_json_file(str(config))
    assert again == args
    assert cls(**json.loads(args.to_json_string())) == args


def test_every_exported_dataclass_builds_an_hf_parser():
    for name in mixprec.__all__:
        cls = getattr(mixprec, name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            parser = transformers.HfArgumentParser(cls)  # raises on a field argparse cannot take
            assert parser.format_help(), name


def test_plain_argparse_helper_from_field_metadata(tmp_path):
    # The hand-written pattern: one option per field, its metadata passed on as add_argument's keywords.
    parser = argparse.ArgumentParser()
    for f in dataclasses.fields(TrainingArguments):
        if f.init and f.default is not dataclasses.MISSING and isinstance(f.default, (int, float, str)):
            kind = type(f.default) if not isinstance(f.default, bool) else None
            parser.add_argument(f"--{f.name}", default=f.default, **({"type": kind} if kind else {}), **f.metadata)
    ns = parser.parse_args(["--output_dir", str(tmp_path), "--learning_rate", "0.01", "--save_steps", "20"])
    args = TrainingArguments(**vars(ns))
    assert args.learning_rate == 0.01 and args.save_steps == 20 and args.output_dir == str(tmp_path)


def test_run_clm_process_helpers_before_any_trainer(tmp_path):
    # run_clm.py, right after parsing: the log level, the parallel mode, and main_process_first around datasets.map
    args = TrainingArguments(str(tmp_path), log_level="info", warmup_ratio=0.1)
    assert args.get_process_log_level() == logging.INFO
    assert args.parallel_mode.value == "not_parallel"
    ran = []
    with args.main_process_first(desc="dataset map tokenization"):
        ran.append(True)
    assert ran == [True] and args.get_warmup_steps(95) == 10  # ceil(0.1 * 95), as HF
    hparams = args.to_sanitized_dict()
    assert hparams["report_to"] == "[]" and hparams["learning_rate"] == args.learning_rate
