"""--config FILE: TOML and YAML keys fill the flags, typed flags win, mistakes are refused by name."""

from __future__ import annotations

import argparse

import pytest

from mixprec.cli._common import add_data_model_args
from mixprec.cli._config_file import add_config_arg, apply_config, dump_toml, explicit_flags, load_config_file
from mixprec.cli.main import CliError


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_config_arg(parser)
    add_data_model_args(parser, batch_size=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compile", action="store_true")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    args = make_parser().parse_args(argv)
    apply_config(args)
    return args


def test_explicit_flags_records_what_was_typed_even_when_it_equals_the_default():
    args = make_parser().parse_args(["--batch-size", "16", "--compile"])
    assert explicit_flags(args) == {"batch_size", "compile"}
    assert explicit_flags(make_parser().parse_args([])) == set()


def test_toml_keys_with_dashes_or_underscores_set_the_flags(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "tiny"\nseq-len = 32\nbatch_size = 4\nlr = 0.01\ncompile = true\nprecision = "bf16"\n')
    args = parse(["--config", str(cfg)])
    assert (args.model, args.seq_len, args.batch_size, args.lr, args.compile) == ("tiny", 32, 4, 0.01, True)
    assert args.precision == "bf16"


def test_flags_on_the_command_line_override_the_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("batch-size = 32\nseq-len = 64\n")
    # 16 is also the default: it must still win, because it was typed
    args = parse(["--config", str(cfg), "--batch-size", "16"])
    assert args.batch_size == 16
    assert args.seq_len == 64


def test_yaml_config(tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\nseq-len: 48\ncompile: false\n")
    args = parse(["--config", str(cfg)])
    assert (args.model, args.seq_len, args.compile) == ("tiny", 48, False)


def test_unknown_keys_are_an_error_naming_them_and_the_valid_ones(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("bach-size = 8\nlearning_rate = 1\n")
    with pytest.raises(CliError) as err:
        parse(["--config", str(cfg)])
    msg = str(err.value)
    assert "'bach-size'" in msg and "'learning_rate'" in msg
    assert "batch-size" in msg.split("valid keys:")[1]


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("batch-size = 2.5", "batch-size"),  # not silently truncated to 2
        ("batch-size = 0", "positive"),
        ("seq-len = 1", "at least 2"),
        ("compile = 1", "true or false"),
        ("lr = [1, 2]", "single value"),
        ("batch-size = true", "batch-size"),
    ],
)
def test_bad_values_are_refused_with_the_key(tmp_path, line, fragment):
    cfg = tmp_path / "c.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(CliError, match=fragment):
        parse(["--config", str(cfg)])


def test_file_problems_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config"):
        parse(["--config", str(tmp_path / "missing.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("batch-size = = 3\n")
    with pytest.raises(CliError, match="not valid TOML"):
        parse(["--config", str(bad)])
    other = tmp_path / "c.ini"
    other.write_text("[x]\n")
    with pytest.raises(CliError, match="unknown format"):
        parse(["--config", str(other)])


def test_a_string_value_goes_through_the_flag_type(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('batch-size = "8"\n')
    assert parse(["--config", str(cfg)]).batch_size == 8


def test_dump_toml_reads_back_as_the_same_flags(tmp_path):
    values = {"model": "tiny", "seq_len": 32, "lr": 0.0025, "compile": False, "data": None, "precision": 'a"b'}
    cfg = tmp_path / "round.toml"
    cfg.write_text(dump_toml(values, header="saved by a test"))
    loaded = load_config_file(cfg)
    assert loaded == {"model": "tiny", "seq-len": 32, "lr": 0.0025, "compile": False, "precision": 'a"b'}
