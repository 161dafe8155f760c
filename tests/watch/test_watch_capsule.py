"""Bad-step capsules (mixprec.watch.capsule, badstep) and their replay (mixprec.watch.replay, `mixprec replay`).

The planted case: one step of a tiny GPT run on which the first MLP input projection of block 1
("transformer.h.1.mlp.c_fc") is scaled up a million-fold, so its output passes fp16's 65504 while fp32 holds
it. The fp16 scaler skips that step; the watch must write a capsule into the run folder, and the replay
must name that module, with fp16's range and the magnitude fp32 saw.
"""

from __future__ import annotations

import json

import pytest
import torch

from mixprec import Accelerator
from mixprec.checkpoint import CheckpointError
from mixprec.cli.main import main
from mixprec.models import GPT
from mixprec.watch.capsule import Capsule
from mixprec.watch.replay import replay

PLANTED = "transformer.h.1.mlp.c_fc"


def _run(
    tmp_path, precision: str, steps: int, plant_at: int | None, factor: float = 1e6, watch=None, planted: str = PLANTED
):
    """Train ``steps`` steps; on step ``plant_at`` (0-based) the ``planted`` module's weight is multiplied by
    ``factor`` for that step only. Returns the watch and the weights each step started from."""
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    acc = Accelerator(
        mixed_precision=precision, cpu=True, watch=watch or {"every": 1000}, project_dir=tmp_path, verbose=False
    )
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    weight = model.get_submodule(planted).weight
    g = torch.Generator().manual_seed(1)
    started_from = []
    for step in range(steps):
        ids = torch.randint(0, 256, (4, 16), generator=g)
        if step == plant_at:
            with torch.no_grad():
                weight.mul_(factor)
        started_from.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        acc.watch.sync(opt)  # as the Trainer does: the step is finished before the plant is undone
        opt.zero_grad()
        if step == plant_at and factor != float("inf"):
            with torch.no_grad():
                weight.div_(factor)
    acc.watch.close()
    return acc.watch, started_from


def test_a_non_finite_fp16_step_writes_a_capsule_that_replays_to_the_planted_module(tmp_path):
    watch, started_from = _run(tmp_path, "fp16", steps=4, plant_at=2)
    (written,) = watch.capsules
    assert written["step"] == 3 and "non-finite" in written["reason"]
    folder = tmp_path / "capsules" / "step-00000003"
    assert written["path"] == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "batch.safetensors",
        "capsule.json",
        "model.safetensors",
        "rng.safetensors",
    ]
    capsule = Capsule.load(folder)
    assert capsule.precision == "fp16" and capsule.meta["model"]["kind"] == "mixprec.gpt"
    for name, value in started_from[2].items():  # the weights the bad step started from
        torch.testing.assert_close(capsule.weights[name], value, rtol=0, atol=0)

    result = replay(folder)
    first = result.first
    assert (first.module, first.phase, first.kind, first.dtype) == (PLANTED, "forward", "non-finite", "float16")
    assert first.dtype_max == 65504.0 and first.fp32_finite
    assert first.max_abs_fp32 > 65504.0  # fp32 held what fp16 could not
    assert torch.isfinite(torch.tensor(result.loss_fp32)) and not torch.isfinite(torch.tensor(result.loss))


def test_mixprec_replay_prints_the_module_and_its_range(tmp_path, capsys):
    watch, _ = _run(tmp_path, "fp16", steps=3, plant_at=1)
    path = watch.capsules[0]["path"]
    assert main(["replay", path]) == 0
    out = capsys.readouterr().out
    assert f"first non-finite: {PLANTED} (forward): float16 holds |x| <= 6.55e+04" in out
    assert main(["replay", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first"]["module"] == PLANTED


def test_a_non_finite_step_in_bf16_gets_a_capsule_too_and_replay_says_fp32_fails_alike(tmp_path):
    # an inf weight: no precision holds it; the non-finite guard skips the step as fp16's scaler would
    watch, _ = _run(tmp_path, "bf16", steps=2, plant_at=1, factor=float("inf"))
    (written,) = watch.capsules
    first = replay(written["path"]).first
    assert (first.module, first.dtype, first.fp32_finite) == (PLANTED, "bfloat16", False)
    assert "not the precision" in first.message()


def test_a_loss_spike_writes_a_capsule_with_the_weights_before_the_update(tmp_path):
    # the final LayerNorm's gain x30 sharpens every logit thirty-fold: the loss jumps, finite
    watch, started_from = _run(
        tmp_path,
        "fp32",
        steps=20,
        plant_at=18,
        factor=30.0,
        watch={"every": 1000, "spike_factor": 1.5},
        planted="transformer.ln_f",
    )
    (written,) = watch.capsules
    assert written["step"] == 19 and written["reason"].startswith("loss ")
    capsule = Capsule.load(written["path"])
    assert capsule.meta["loss"] > 1.5 * 5.0  # the spiked loss, read before the update
    for name, value in started_from[18].items():
        torch.testing.assert_close(capsule.weights[name], value, rtol=0, atol=0)
    assert replay(capsule).first is None  # fp32 run, fp32 replay: nothing parts


def test_no_run_folder_no_capsule_and_the_limit_holds(tmp_path):
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    acc = Accelerator(mixed_precision="fp16", cpu=True, watch={"every": 1000, "max_capsules": 1}, verbose=False)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        model.get_submodule(PLANTED).weight.mul_(1e6)
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    acc.watch.sync(opt)
    assert acc.watch.skips and acc.watch.capsules == []  # attributed, but nowhere to write
    acc.watch.set_run_folder(tmp_path)
    for _ in range(2):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        acc.watch.sync(opt)
    assert len(acc.watch.capsules) == 1


def test_a_changed_capsule_is_refused_by_name(tmp_path, capsys):
    watch, _ = _run(tmp_path, "fp16", steps=2, plant_at=0)
    folder = tmp_path / "capsules" / "step-00000001"
    data = bytearray((folder / "batch.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "batch.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="batch.safetensors: missing or changed"):
        Capsule.load(folder)
    assert main(["replay", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mixprec replay: error:") and "batch.safetensors" in err and "\n" not in err


class _Cancel(torch.nn.Module):
    """(y + 1e4) - 1e4: exact in fp32, but in bf16 (ulp 64 at 1e4) it wipes out y: a finite divergence."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return (y + 1e4) - 1e4


class _Cancelling(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.cancel = _Cancel()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.head(self.cancel(self.proj(x))).float().squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, y)}


def test_replay_names_the_first_module_whose_finite_output_leaves_fp32s(tmp_path):
    from mixprec.watch.capsule import write_capsule

    torch.manual_seed(0)
    model = _Cancelling()
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4)}
    path = write_capsule(
        tmp_path,
        step=7,
        reason="planted",
        model=model,
        batches=[batch],
        rng=(torch.get_rng_state(), None),
        precision="bf16",
        loss=None,
        loss_scale=1.0,
        fallbacks=[],
        optimizer=None,
    )
    assert Capsule.load(path).meta["model"]["kind"] == "python"
    with pytest.raises(ValueError, match=r"replay it from Python: mixprec.watch.replay\(CAPSULE, model="):
        replay(path)
    first = replay(path, model=_Cancelling()).first
    assert (first.module, first.phase, first.kind, first.dtype) == ("cancel", "forward", "diverged", "bfloat16")
    assert first.rel_error > 0.1 and first.fp32_finite


def test_a_transformers_model_is_rebuilt_from_the_capsule_alone(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mixprec.watch.capsule import write_capsule

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    path = write_capsule(
        tmp_path,
        step=3,
        reason="planted",
        model=model,
        batches=[{"input_ids": ids, "labels": ids}],
        rng=(torch.get_rng_state(), None),
        precision="bf16",
        loss=None,
        loss_scale=1.0,
        fallbacks=[],
        optimizer="AdamW",
    )
    result = replay(path)  # no model passed: `mixprec replay` works for it
    expected = float(model(input_ids=ids, labels=ids).loss)
    assert result.loss_fp32 == pytest.approx(expected, rel=1e-6)  # the very weights, in a rebuilt GPT2LMHeadModel
    assert result.first is None  # one bf16 layer stays within 10% of fp32


def test_mixprec_replay_names_a_bad_flag_or_folder(tmp_path, capsys):
    assert main(["replay", str(tmp_path), "--tol", "0"]) == 2
    assert "--tol 0.0: the relative distance must be > 0" in capsys.readouterr().err
    assert main(["replay", str(tmp_path)]) == 2
    assert "no capsule.json here; pass a capsule folder" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["foo", "cuda:0"])
def test_mixprec_replay_refuses_a_bad_device_in_one_line(tmp_path, capsys, device):
    # issue 34: --device foo ended in torch's RuntimeError traceback
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA device is present: cuda:0 is a good device here")
    watch, _ = _run(tmp_path, "fp16", steps=2, plant_at=0)
    capsys.readouterr()  # the run's own warnings
    assert main(["replay", watch.capsules[0]["path"], "--device", device]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mixprec replay: error: --device {device}: ")
