"""The precision watch on a planted fault: one layer whose activations grow until fp16 overflows.

The model is x -> Linear "inp" -> ReLU -> Linear "grow" -> LayerNorm -> Linear "out" -> MSE loss. After each
optimizer step a callback multiplies "grow"'s weight and bias by 1.4, so its outputs grow ~0.49 binades per
step and pass fp16's 65504 at a step measured below in fp32; the LayerNorm right after divides the growth
out, so in fp32 (and in fp32 inside "grow") the loss does not care. In fp16 the overflow makes every later
step's loss inf/NaN: the scaler skips, halves, and skips again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import Trainer, TrainerCallback, TrainingArguments
from mixprec.trainer.logging import read_metrics

GROWTH = 1.4
STEPS = 60
FP16_MAX = 65504.0


class Planted(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.grow = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.norm(self.grow(torch.relu(self.inp(x))))
        return {"loss": F.mse_loss(self.out(h).float().squeeze(-1), y)}


class GrowEachStep(TrainerCallback):
    def __init__(self, model: Planted) -> None:
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        with torch.no_grad():
            self.model.grow.weight.mul_(GROWTH)
            self.model.grow.bias.mul_(GROWTH)


class RecordGrowMax(TrainerCallback):
    """The largest |output| of "grow" on each step (fp32 reference run): where fp16 would overflow."""

    def __init__(self, model: Planted) -> None:
        self.per_step: list[float] = []
        self._last = 0.0
        model.grow.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self._last = float(output.detach().abs().max())

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self._last)


def dataset(n: int = 256, d: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, generator=g)
    y = torch.tanh(x @ w / 4) + 0.5 * torch.sin(x[:, 0])
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def train(
    out: Path,
    precision: str,
    watch=None,
    *,
    record=False,
    steps=STEPS,
    resume=None,
    save_steps=None,
    accumulate=1,
    max_skips=None,
):
    torch.manual_seed(0)
    model = Planted()
    args = TrainingArguments(
        output_dir=str(out),
        precision=precision,
        max_steps=steps,
        per_device_train_batch_size=16 // accumulate,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=10,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        disable_tqdm=True,
        init_loss_scale=2.0**10,  # below the gradients' limit: the only skips are the planted overflow's
        max_consecutive_skips=max_skips,
        precision_watch=watch,
    )
    callbacks = [GrowEachStep(model)]
    recorder = RecordGrowMax(model) if record else None
    if recorder is not None:
        callbacks.append(recorder)
    data = dataset()
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=callbacks)
    output = trainer.train(resume_from_checkpoint=resume)
    return trainer, output, recorder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    fp32 = train(root / "fp32", "fp32", record=True)
    watch = train(root / "watch", "fp16", "watch:2")
    fallback = train(root / "fallback", "fp16", "fallback:2")
    return {"fp32": fp32, "watch": watch, "fallback": fallback, "root": root}


def _events(trainer: Trainer, kind: str) -> list[dict]:
    return [e for e in read_metrics(Path(trainer.args.output_dir) / "metrics.jsonl") if e.get("event") == kind]


@pytest.mark.slow
def test_the_warning_names_the_layer_before_the_first_skip(runs):
    overflow_step = next(i + 1 for i, m in enumerate(runs["fp32"][2].per_step) if m > FP16_MAX)
    assert 20 < overflow_step < STEPS - 10  # the plant works as designed (a known step, mid-run)
    trainer = runs["watch"][0]
    warnings = _events(trainer, "precision_warning")
    skips = _events(trainer, "skipped_step")
    assert warnings and skips
    first = warnings[0]
    assert first["layer"] == "grow" and first["fmt"] == "fp16"
    assert first["step"] < skips[0]["step"] == overflow_step
    assert first["steps_left"] is not None and first["step"] + first["steps_left"] <= overflow_step + 2


@pytest.mark.slow
def test_without_fallback_the_scaler_skips_every_step_and_each_skip_is_traced_to_the_layer(runs):
    trainer, output, _ = runs["watch"]
    assert output.metrics["skipped_steps"] >= 20
    traced = _events(trainer, "skip_attribution")
    assert len(traced) == output.metrics["skipped_steps"]
    assert {(e["module"], e["phase"], e["what"]) for e in traced} == {("grow", "forward", "output")}
    summary = json.loads((Path(trainer.args.output_dir) / "train_summary.json").read_text())
    watch = summary["precision_watch"]
    assert watch["skipped_steps_by_module"] == {"grow": output.metrics["skipped_steps"]}
    assert watch["fp32_fallback"] == []


@pytest.mark.slow
def test_with_fallback_the_run_finishes_like_fp32(runs):
    fp32_trainer = runs["fp32"][0]
    trainer, output, _ = runs["fallback"]
    assert 1 <= output.metrics["skipped_steps"] <= 2
    fallbacks = _events(trainer, "precision_fallback")
    assert [f["module"] for f in fallbacks] == ["grow"]
    summary = json.loads((Path(trainer.args.output_dir) / "train_summary.json").read_text())
    assert [f["module"] for f in summary["precision_watch"]["fp32_fallback"]] == ["grow"]
    assert summary["precision_watch"]["skipped_steps_by_module"] == {"grow": output.metrics["skipped_steps"]}
    ref = fp32_trainer.evaluate()["eval_loss"]
    got = trainer.evaluate()["eval_loss"]
    assert abs(got - ref) <= 0.02 * ref, (got, ref)
    assert (Path(trainer.args.output_dir) / "precision_headroom.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_fallback_survives_a_resume(tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="mixprec.watch"):
        trainer, _, _ = train(out, "fp16", "fallback:2", steps=45, save_steps=40)
    assert "is running out of fp16 range" in caplog.text and "layer 'grow'" in caplog.text
    assert "first non-finite: grow (forward, output, float16)" in caplog.text
    assert "module 'grow' runs in fp32 from step" in caplog.text
    assert [f["module"] for f in trainer.accelerator.watch.fallbacks] == ["grow"]
    resumed, output, _ = train(out, "fp16", "fallback:2", steps=50, resume=True)
    watch = resumed.accelerator.watch
    assert [f["module"] for f in watch.fallbacks] == ["grow"]
    assert output.metrics["skipped_steps"] == trainer.skipped_steps  # no new skip after the resume


@pytest.mark.slow
def test_with_gradient_accumulation_every_micro_batch_is_watched_and_replayed(tmp_path):
    trainer, output, _ = train(tmp_path / "acc", "fp16", "fallback:2", steps=45, accumulate=2)
    watch = trainer.accelerator.watch
    assert [w.layer for w in watch.warnings] == ["grow"]
    assert [(a.module, a.phase) for a in watch.skips] == [("grow", "forward")] * output.metrics["skipped_steps"]
    assert [f["module"] for f in watch.fallbacks] == ["grow"] and output.metrics["skipped_steps"] <= 2


@pytest.mark.slow
def test_the_consecutive_skip_error_names_the_layer_the_watch_traced(tmp_path):
    from mixprec import ConsecutiveSkipsError

    with pytest.raises(ConsecutiveSkipsError, match=r"precision watch traced the skipped steps to: grow \(4 skips\)"):
        train(tmp_path / "stop", "fp16", "watch:2", max_skips=5)


@pytest.mark.slow
def test_the_trainer_writes_capsules_into_output_dir_and_the_replay_names_the_layer(runs):
    from mixprec.watch.replay import replay

    trainer, output, _ = runs["watch"]
    out = Path(trainer.args.output_dir)
    folders = sorted((out / "capsules").iterdir())
    assert len(folders) == 8 < output.metrics["skipped_steps"]  # one per skipped step, up to max_capsules
    assert [e["path"] for e in _events(trainer, "capsule")] == [str(f) for f in folders]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["precision_watch"]["capsules"][0]["path"] == str(folders[0])
    # a model of the user's own: the capsule names its class; the replay is handed one to load the weights into
    result = replay(folders[0], model=Planted())
    assert (result.first.module, result.first.kind, result.first.dtype) == ("grow", "non-finite", "float16")
    assert result.first.fp32_finite and result.first.max_abs_fp32 > FP16_MAX
