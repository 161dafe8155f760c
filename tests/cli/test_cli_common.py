"""The shared --data/--model flags: what load_model_and_data builds, and the input it refuses by name."""

from __future__ import annotations

import argparse

import pytest

from mixprec.cli._common import add_data_model_args, load_model_and_data, parse_precision
from mixprec.cli.main import CliError


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="t")
    add_data_model_args(parser)
    return parser.parse_args(argv)


def test_unknown_precision_lists_the_valid_names():
    with pytest.raises(CliError) as err:
        parse_precision("fp17")
    assert "fp17" in str(err.value)
    for name in ("no", "fp16", "bf16", "auto"):
        assert name in str(err.value)
    assert parse_precision("16-mixed").name == "fp16"


def test_load_model_and_data_refuses_a_sequence_longer_than_the_block(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 400)
    args = parse(["--data", str(corpus), "--model", "tiny", "--seq-len", "65"])
    with pytest.raises(CliError, match="block size 64"):
        load_model_and_data(args)


def test_load_model_and_data_builds_the_tiny_model_and_datasets(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 400)  # 4,800 bytes
    args = parse(["--data", str(corpus), "--model", "tiny"])
    model, train, val, info = load_model_and_data(args)
    assert info.seq_len == 64  # the tiny model's block size, below the default 256
    assert info.train_tokens + info.val_tokens == 4800
    assert len(train) == info.train_tokens // 64 and len(val) == info.val_tokens // 64
    assert train[0]["input_ids"].shape == (64,)
    out = model(train[0]["input_ids"][None], labels=train[0]["labels"][None])
    assert out.loss.ndim == 0
    assert 0 < info.unigram_baseline < 5.55


def test_model_that_is_neither_a_preset_nor_a_path():
    args = parse(["--model", "gpt-17"])
    with pytest.raises(CliError, match="not a built-in model"):
        load_model_and_data(args)


def test_hf_config_folder_builds_a_transformers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    cfg.save_pretrained(tmp_path / "hf")
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc " * 500)
    args = parse(["--data", str(corpus), "--model", str(tmp_path / "hf")])
    model, train, _, info = load_model_and_data(args)
    assert not info.builtin and info.block_size == 32 and info.seq_len == 32
    assert "GPT2LMHeadModel" in info.model_description
    batch = train[0]
    assert model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.ndim == 0

    small = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    small.save_pretrained(tmp_path / "hf_small_vocab")
    args = parse(["--data", str(corpus), "--model", str(tmp_path / "hf_small_vocab")])
    with pytest.raises(CliError, match="vocab_size 100"):
        load_model_and_data(args)


def test_a_subcommand_sets_its_own_default_sequence_length(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 400)
    parser = argparse.ArgumentParser(prog="t")
    add_data_model_args(parser, seq_len=48)
    _, train, _, info = load_model_and_data(parser.parse_args(["--data", str(corpus), "--model", "tiny"]))
    assert info.seq_len == 48 and train[0]["input_ids"].shape == (48,)
    parser = argparse.ArgumentParser(prog="t")
    add_data_model_args(parser, seq_len=1000)  # capped at the tiny model's block size
    assert load_model_and_data(parser.parse_args(["--data", str(corpus), "--model", "tiny"]))[3].seq_len == 64


def test_fp32_ops_flag_folds_into_the_precision_and_a_typo_is_one_line():
    from mixprec.cli._common import parse_precision

    assert parse_precision("bf16", "attention").name == "bf16:fp32_ops=attention"
    assert parse_precision("bf16:fp32_ops=attention").name == "bf16:fp32_ops=attention"  # the same, spelled out
    # a policy's own kinds stay beside the flag's (attention was dropped)
    assert parse_precision("fp16:fp32_ops=attention", "norm").name == "fp16:fp32_ops=attention,norm"
    with pytest.raises(CliError, match=r"^--fp32-ops: .*unknown op kind 'attn'; choose from: linear, attention"):
        parse_precision("bf16", "attn")


def test_fp32_ops_is_a_config_file_key(tmp_path):
    from mixprec.cli._config_file import apply_config
    from mixprec.cli.main import build_parser

    config = tmp_path / "run.toml"
    config.write_text('precision = "bf16"\nfp32_ops = "attention,norm"\n')
    args = build_parser().parse_args(["train", "--config", str(config)])
    apply_config(args)
    assert parse_precision(args.precision, args.fp32_ops).name == "bf16:fp32_ops=attention,norm"
