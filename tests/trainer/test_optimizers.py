"""TrainingArguments(optim=...): HF's optimizer names and optim_args, the low-bit states, and their errors.

The torchao 8/4-bit optimizers compile their step on first use (tens of seconds on a CPU), so only the tests
marked slow step them; everything else checks construction, which does not compile.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mixprec import Trainer, TrainingArguments
from mixprec.cli.main import main
from mixprec.optim import AnyPrecisionAdamW
from mixprec.trainer.optimizers import OPTIMIZER_NAMES, build_optimizer, parse_optim_args
from trainer_utils import make_examples, make_model

PIP = 'pip install "mixprec[lean]"'


def args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, save_plots=False, logging_steps=1)
    return TrainingArguments(**{**base, **kw})


# -- names and options ----------------------------------------------------------------------------------


def test_hf_names_build_the_optimizers_they_name(tmp_path):
    pytest.importorskip("torchao")
    model = make_model(width=128)
    built = {name: build_optimizer(model, args(tmp_path, optim=name).optimization) for name in OPTIMIZER_NAMES}
    kinds = {name: type(opt).__name__ for name, opt in built.items()}
    assert kinds == {
        "adamw_torch": "AdamW",
        "adamw_torch_fused": "AdamW",
        "adamw_torch_8bit": "AdamW8bit",
        "adamw_torch_4bit": "AdamW4bit",
        "adamw_anyprecision": "AnyPrecisionAdamW",
        "sgd": "SGD",
    }
    # issue 36: torch's fused kernel by default where it has one (here, the CPU), not its single-tensor loop
    assert built["adamw_torch_fused"].defaults["fused"] and built["adamw_torch"].defaults["fused"]
    # HF's block size for both torchao optimizers (HF passes 256 to AdamW4bit too, over torchao's own 128)
    assert built["adamw_torch_8bit"].block_size == built["adamw_torch_4bit"].block_size == 256
    # the same decay rule everywhere: matrices decayed, biases not
    assert [g["weight_decay"] for g in built["adamw_torch_8bit"].param_groups] == [0.0, 0.0]
    decayed = build_optimizer(model, args(tmp_path, optim="adamw_torch_4bit", weight_decay=0.1).optimization)
    assert [g["weight_decay"] for g in decayed.param_groups] == [0.1, 0.0]


def test_an_unknown_optimizer_is_one_line_listing_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        args(tmp_path, optim="adamw_bnb_8bit")
    message = str(err.value)
    assert message.startswith("TrainingArguments(optim='adamw_bnb_8bit'): choose one of: ")
    assert all(repr(name) in message for name in OPTIMIZER_NAMES) and "\n" not in message


def test_optim_args_take_hfs_string_form_and_defaults():
    assert parse_optim_args("adamw_anyprecision", None) == {
        "use_kahan_summation": False,
        "momentum_dtype": torch.float32,
        "variance_dtype": torch.float32,
        "compensation_buffer_dtype": torch.bfloat16,
    }
    text = "use_kahan_summation=True, momentum_dtype=bfloat16,variance_dtype=bfloat16"
    parsed = parse_optim_args("adamw_anyprecision", text)
    assert parsed["use_kahan_summation"] is True and parsed["variance_dtype"] is torch.bfloat16
    assert parse_optim_args("adamw_torch_8bit", "block_size=128,bf16_stochastic_round=1") == {
        "block_size": 128,
        "bf16_stochastic_round": True,
    }
    assert parse_optim_args("sgd", "momentum=0.9,nesterov=true")["nesterov"] is True


@pytest.mark.parametrize(
    "optim, text, message",
    [
        ("adamw_anyprecision", "momentum_dtype=float8", r"momentum_dtype='float8' must be one of float32, bfloat16"),
        ("adamw_anyprecision", "use_kahan=True", r"takes no 'use_kahan'; valid keys: use_kahan_summation, "),
        ("adamw_torch_8bit", "block_size=0", r"block_size='0' must be a positive integer"),
        ("adamw_torch", "foo=1", r"optim='adamw_torch' takes no 'foo'; valid keys: fused"),
        ("adamw_torch_fused", "foo=1", r"optim='adamw_torch_fused' takes no 'foo'; valid keys: none"),
        ("adamw_torch", "fused=maybe", r"fused='maybe' must be True or False"),
        ("adamw_torch_4bit", "block_size", r"'block_size' is not key=value"),
    ],
)
def test_bad_optim_args_name_the_field_the_key_and_the_fix(tmp_path, optim, text, message):
    with pytest.raises(ValueError, match=rf"TrainingArguments\(optim_args=.*\): .*{message}"):
        args(tmp_path, optim=optim, optim_args=text)


def test_adamw_torch_is_fused_where_torch_has_the_kernel_and_fused_false_keeps_its_default(tmp_path):
    model = make_model(width=32)
    assert build_optimizer(model, args(tmp_path).optimization).defaults["fused"]  # the default optim, on a CPU
    plain = build_optimizer(model, args(tmp_path, optim_args="fused=False").optimization)
    assert not plain.defaults["fused"] and not plain.defaults["foreach"]  # torch's own choice: the loop on a CPU
    # a tensor the kernel cannot take (an integer parameter, frozen or not) keeps torch's default, not an error
    int_groups = [{"params": [torch.zeros(3, dtype=torch.int64)]}, {"params": [torch.zeros(3)]}]
    from mixprec.trainer.optimizers import fused_kernel_takes

    assert not fused_kernel_takes(int_groups) and fused_kernel_takes(int_groups[1:])


def test_the_fused_default_trains_like_the_loop_and_skips_an_overflowing_fp16_step_alike(tmp_path):
    """The fused kernel under mixprec's scaler (its grad_scale / found_inf, fp32 weights, fp16 autocast on a
    CPU): the same skipped steps and scales as the single-tensor loop, weights within the kernel's rounding
    (it is not bit-identical: lr * m / (sqrt(v) + eps) in another order; 1e-5 relative over 8 steps)."""

    def run(optim_args: str | None) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = make_model(width=32)
        trainer = Trainer(
            model,
            args(
                tmp_path / str(optim_args),
                max_steps=8,
                precision="fp16",
                optim_args=optim_args,
                learning_rate=1e-2,
                per_device_train_batch_size=4,
                init_loss_scale=2.0**40,
            ),
            train_dataset=make_examples(64),
        )
        out = trainer.train()
        return [p.detach().clone() for p in model.parameters()], out.metrics

    (fused_w, fused_m), (loop_w, loop_m) = run(None), run("fused=False")
    assert fused_m["skipped_steps"] == loop_m["skipped_steps"] >= 1  # a first scale of 2**40 overflows fp16
    assert fused_m["final_loss_scale"] == loop_m["final_loss_scale"]
    for a, b in zip(fused_w, loop_w, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- torchao missing ------------------------------------------------------------------------------------


def test_without_torchao_a_low_bit_optimizer_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` meets when it is not installed
    cfg = args(tmp_path, optim="adamw_torch_8bit").optimization  # the name is valid without torchao
    with pytest.raises(ImportError, match=r"optim='adamw_torch_8bit' needs torchao>=0.18") as err:
        build_optimizer(make_model(), cfg)
    assert str(err.value).endswith(PIP) and isinstance(err.value, ValueError)
    # the others do not need it
    assert type(build_optimizer(make_model(), args(tmp_path, optim="adamw_anyprecision").optimization)).__name__


def test_the_cli_says_it_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x): return x * {i}\n" for i in range(300)))
    fast = ["--data", str(corpus), "--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--max-steps", "1"]
    assert main(["train", *fast, "--precision", "fp32", "--optim", "adamw_torch_4bit", "--output-dir", "r1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    missing = f"optim='adamw_torch_4bit' needs torchao>=0.18, which is not installed: {PIP}"
    assert err[-1] == f"mixprec train: error: {missing}"
    assert not any("Traceback" in line for line in err)
    assert main(["train", *fast, "--precision", "fp32", "--optim", "adam", "--output-dir", "r2"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mixprec train: error: TrainingArguments(optim='adam'): choose one of: 'adamw_torch', ")


# -- adamw_anyprecision ---------------------------------------------------------------------------------


def _fit(optimizer_cls, steps: int = 30, **kw) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = optimizer_cls(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        torch.nn.functional.mse_loss(model(x), x[:, :4]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_anyprecision_with_fp32_moments_is_torchs_adamw():
    ours, _ = _fit(AnyPrecisionAdamW)
    theirs, _ = _fit(torch.optim.AdamW)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # same algorithm; fp32 op order differs


def test_anyprecision_bf16_moments_halve_the_state_and_track_adamw():
    ours, opt = _fit(AnyPrecisionAdamW, momentum_dtype=torch.bfloat16, variance_dtype=torch.bfloat16)
    theirs, _ = _fit(torch.optim.AdamW)
    state = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert {t.dtype for t in state} == {torch.bfloat16}
    # bf16 moments round each moment to 8 bits; after 30 steps at lr 1e-2 the weights stay within 1e-2
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)


def test_kahan_summation_keeps_small_updates_to_bf16_weights():
    # Planted case: weights of 1.0 in bf16 (ulp 2^-7) and updates of lr=1e-3 (Adam's step is ~lr): each is
    # under half an ulp, so round-to-nearest drops every one; Kahan's buffer carries them until they add up.
    def run(kahan: bool) -> torch.Tensor:
        w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        opt = AnyPrecisionAdamW([w], lr=1e-3, use_kahan_summation=kahan)
        for _ in range(100):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.float()

    assert torch.all(run(kahan=False) == 1.0)  # 100 updates of -1e-3 all lost
    kept = run(kahan=True)
    torch.testing.assert_close(kept, torch.full_like(kept, 1.0 - 100 * 1e-3), rtol=0, atol=2**-8)


def _trainer(tmp_path, max_steps: int, optim: str, optim_args: str | None) -> Trainer:
    a = args(tmp_path, optim=optim, optim_args=optim_args, max_steps=max_steps, save_steps=2, learning_rate=1e-2)
    return Trainer(make_model(width=128), a, train_dataset=make_examples(64))


def _resume_is_exact(tmp_path, optim: str, optim_args: str | None = None) -> Trainer:
    full = _trainer(tmp_path / "full", 4, optim, optim_args)
    full.train()
    resumed = _trainer(tmp_path / "full", 4, optim, optim_args)  # resumes from checkpoint-2
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    return resumed


def test_anyprecision_resumes_exactly_with_its_moments_still_bf16(tmp_path):
    resumed = _resume_is_exact(tmp_path, "adamw_anyprecision", "momentum_dtype=bfloat16,variance_dtype=bfloat16")
    # torch's loader casts optimizer state to the parameters' dtype: the saving must survive a resume
    state = resumed.optimizer.optimizer.state.values()
    assert {t.dtype for s in state for k, t in s.items() if k != "step"} == {torch.bfloat16}


# -- torchao's 8/4-bit states (compiles: slow) ----------------------------------------------------------


@pytest.mark.slow
def test_low_bit_states_quantise_large_tensors_and_keep_small_ones_fp32(tmp_path):
    pytest.importorskip("torchao")
    from torchao.optim.subclass_4bit import OptimState4bit

    resumed = _resume_is_exact(tmp_path, "adamw_torch_4bit")
    state = {name: resumed.optimizer.optimizer.state[p] for name, p in resumed.model.named_parameters()}
    # torchao quantises a moment only for tensors of >= 4096 elements, a multiple of the block size
    assert isinstance(state["hidden.weight"]["exp_avg"], OptimState4bit)  # 128 x 128
    for small in ("hidden.bias", "head.weight", "embed.weight"):  # 128, 16 x 128 = 2048, 16 x 128
        assert type(state[small]["exp_avg"]) is torch.Tensor and state[small]["exp_avg"].dtype == torch.float32


# -- schedules --------------------------------------------------------------------------------------------


def test_nanogpt_cosine_trains_from_the_first_step_and_then_follows_hf_cosine(tmp_path):
    # nanoGPT's get_lr (min_lr 0): its first step trains at lr / (warmup + 1), where HF's cosine spends step 0
    # at lr 0; after the warm-up both are the same cosine down to 0 (mixprec train's default, issue 23)
    from mixprec.trainer.optimizers import build_scheduler

    def lrs(kind: str) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        sched = build_scheduler(opt, args(tmp_path, lr_scheduler_type=kind, warmup_steps=4).schedule, 20)
        out = []
        for _ in range(21):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    nano, hf = lrs("nanogpt_cosine"), lrs("cosine")
    assert nano[:4] == pytest.approx([3e-3 * (k + 1) / 5 for k in range(4)])
    assert hf[0] == 0.0
    assert nano[4:] == pytest.approx(hf[4:]) and nano[4] == pytest.approx(3e-3) and nano[20] == 0.0


def test_an_unknown_schedule_is_refused_listing_nanogpt_cosine(tmp_path):
    with pytest.raises(ValueError, match="lr_scheduler_type.*nanogpt_cosine"):
        args(tmp_path, lr_scheduler_type="cosine_nano")
