"""benchmarks/bench_bare_step.py: the bare step each variant times is a real training step in its precision."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_bare_step
from mixprec.models import GPT, GPTConfig


def _tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32))


@pytest.mark.parametrize(("name", "linear_dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_step_trains_the_model_with_its_matmuls_in_the_asked_dtype(name, linear_dtype):
    model = _tiny()
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randint(256, (2, 9), generator=torch.Generator().manual_seed(0))
    step = bench_bare_step.make_step("mixprec", model, name, batch)
    step()
    assert seen == [linear_dtype]
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "transformer.h.0.mlp.c_fc.weight" in changed  # the optimizer stepped


def test_the_attention_policy_runs_attention_in_fp32_and_the_rest_in_bf16():
    model = _tiny()
    attention_inputs = []
    model.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda mod, inp: attention_inputs.append(inp[0].dtype))
    batch = torch.randint(256, (2, 9), generator=torch.Generator().manual_seed(0))
    bench_bare_step.make_step("mixprec", model, "bf16:fp32_ops=attention", batch)()
    assert attention_inputs == [torch.float32]  # the attention's output, before c_proj's autocast


def test_the_report_times_every_variant_and_its_ratio_to_its_own_fp32(tmp_path, capsys):
    out = tmp_path / "bare.json"
    argv = ["--model", "tiny", "--batch-size", "2", "--seq-len", "8", "--rounds", "2", "--steps", "1"]
    figures = bench_bare_step.main([*argv, "--warmup", "0", "--threads", "1", "--json", str(out)])
    assert set(figures) == {f"mixprec {p}" for p in bench_bare_step.PRECISIONS}
    assert figures["mixprec fp32"]["vs_own_fp32"] == 1.0
    assert all(row["ms_per_step"] > 0 for row in figures.values())
    assert json.loads(out.read_text())["figures"] == figures
    assert "mixprec bf16:fp32_ops=attention" in capsys.readouterr().out


def test_a_nanogpt_folder_without_model_py_is_named_in_the_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_bare_step.parse_args(["--nanogpt", str(tmp_path)])
    assert f"--nanogpt {tmp_path} has no model.py" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_naming_the_fix(capsys):
    with pytest.raises(SystemExit):
        bench_bare_step.parse_args(["--device", "cuda"])
    assert "--device cuda: CUDA is not available on this machine; use --device cpu" in capsys.readouterr().err


@pytest.mark.gpu
def test_on_a_gpu_every_variant_times_a_step_on_the_device():
    argv = ["--model", "tiny", "--batch-size", "2", "--seq-len", "8", "--rounds", "2", "--steps", "2"]
    figures = bench_bare_step.main([*argv, "--device", "cuda", "--warmup", "1"])
    assert all(row["ms_per_step"] > 0 for row in figures.values())
