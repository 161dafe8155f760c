"""`mixprec train --model <local HF folder> --lora-r N`: LoRA adapters on a frozen half-precision base, from
the command line; resumable with the run's own flags; bad LoRA flags are one line naming the flag and the fix."""

from __future__ import annotations

import sys

import pytest
import torch

from mixprec.cli.main import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

FAST = ["--seq-len", "32", "--batch-size", "4", "--epoch-tokens", "256"]
pytestmark = pytest.mark.usefixtures("quick_train_cli")  # conftest.py: tmp_path as cwd, a short sample, one thread


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A tiny GPT-2 saved with its (fp32) weights, as a user's local model folder."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return str(path)


def test_lora_r_trains_adapters_on_a_frozen_fp16_base_and_resumes(tmp_path, corpus, hf_folder, capsys):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    argv = ["--data", corpus, "--model", hf_folder, *FAST, "--precision", "fp16", "--lora-r", "4"]
    assert main(["train", *argv, "--max-steps", "2", "--output-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "adapters    LoRA r=4, alpha 8 on c_attn:" in out and "frozen base in float16" in out
    assert "2 (1 epochs), 0 skipped" in out
    saved = load_file(run / "checkpoint-2" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # the adapters only: the frozen base is --model's
    assert {v.dtype for v in saved.values()} == {torch.float32}  # peft's fp32 adapters
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # B starts at 0: it learned

    assert main(["train", "--resume", str(run), "--max-steps", "3"]) == 0  # the run's own flags: --lora-r 4
    out = capsys.readouterr().out
    assert "adapters    LoRA r=4" in out and "resuming from checkpoint-2" in out and "3 (1.5 epochs)" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--model", "tiny", "--lora-r", "4"], "--lora-r 4: LoRA adapters go on a Hugging Face model; pass --model"),
        (["--lora-alpha", "16"], "--lora-alpha needs --lora-r N"),
        (["--lora-targets", "q_proj"], "--lora-targets needs --lora-r N"),
        (["--lora-r", "2", "--lora-targets", "nope"], "--lora-targets: peft cannot adapt this model"),
    ],
)
def test_bad_lora_flags_are_one_line_naming_the_flag(tmp_path, corpus, hf_folder, capsys, argv, fragment):
    model = [] if "--model" in argv else ["--model", hf_folder]
    assert main(["train", "--data", corpus, *model, *FAST, "--precision", "fp32", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mixprec train: error:")]
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "runs").exists()


def test_lora_r_without_peft_says_to_install_it(tmp_path, corpus, hf_folder, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails as if it were not installed
    assert main(["train", "--data", corpus, "--model", hf_folder, *FAST, "--lora-r", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    fix = "pip install peft (or pip install 'mixprec[lora]')"
    assert err[-1] == f"mixprec train: error: --lora-r 8: LoRA needs peft; {fix}"
