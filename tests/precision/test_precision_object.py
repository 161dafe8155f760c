"""A precision strategy travels from the edge to the step: the Accelerator, TrainingArguments and
``mixprec train`` take a ``Precision`` made once (``make_precision``) and run that very object; names keep
working, and the registry answers the questions callers used to ask of name strings."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec import Accelerator
from mixprec.precision import registry
from mixprec.precision.auto import AutoPrecision
from mixprec.precision.registry import autocast_format, autocast_modes, hf_flags, make_precision


def _step(acc: Accelerator) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(2, 8)).float().pow(2).mean())
    opt.step()
    opt.zero_grad()


def test_an_accelerator_given_a_strategy_runs_that_object():
    p = make_precision("fp16", "cpu")
    acc = Accelerator(mixed_precision=p, verbose=False)
    assert acc.precision is p and acc.mixed_precision == "fp16"
    _step(acc)
    assert acc.scaler is p.scaler and p.scaler.record.steps == 1  # the step went through the object's scaler


def test_an_accelerator_given_auto_races_with_that_object():
    auto = make_precision("auto", "cpu")
    assert isinstance(auto, AutoPrecision)
    acc = Accelerator(mixed_precision=auto, verbose=False)
    assert acc.precision_pending and acc.mixed_precision == "auto"
    assert acc.precision is auto.resolved


def test_names_and_strategies_give_the_same_mode():
    for name in ("no", "bf16-mixed", "16-mixed", "bf16:fp32_ops=attention"):
        by_name = Accelerator(mixed_precision=name, device="cpu", verbose=False)
        by_object = Accelerator(mixed_precision=make_precision(name, "cpu"), verbose=False)
        assert by_object.mixed_precision == by_name.mixed_precision
        assert by_object.precision.compute_dtype == by_name.precision.compute_dtype


def test_a_strategy_made_for_another_device_or_with_fp32_ops_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"made for device 'meta' but runs on 'cpu'; make it with make_precision"):
        Accelerator(mixed_precision=make_precision("fp32", "meta"), device="cpu", verbose=False)
    with pytest.raises(ValueError, match=r"Accelerator\(fp32_ops='attention'\): .*make_precision\('bf16:fp32_ops="):
        Accelerator(mixed_precision=make_precision("bf16", "cpu"), fp32_ops="attention", verbose=False)


def test_training_arguments_keep_a_strategy_and_save_its_name(tmp_path):
    from mixprec.trainer.args import TrainingArguments

    p = make_precision("bf16", "cpu")
    args = TrainingArguments(output_dir=str(tmp_path), precision=p)
    # the public field stays a name (HfArgumentParser, JSON, YAML build it); the strategy is kept beside it
    assert args.precision == "bf16" and args.precision_strategy is p and args.bf16 and not args.fp16
    assert args.to_dict()["precision"] == "bf16"  # JSON-ready
    with pytest.raises(ValueError, match=r"conflicts with fp16=True"):
        TrainingArguments(output_dir=str(tmp_path), precision=make_precision("bf16", "cpu"), fp16=True)
    with pytest.raises(ValueError, match=r"TrainingArguments\(fp32_ops="):
        TrainingArguments(output_dir=str(tmp_path), precision=make_precision("bf16", "cpu"), fp32_ops=["norm"])
    with pytest.raises(ValueError, match=r"step_in_backward"):
        TrainingArguments(
            output_dir=str(tmp_path), precision=make_precision("fp16", "cpu"), step_in_backward=True, max_grad_norm=0
        )


@pytest.mark.parametrize(
    ("name", "scales", "flags", "fmt"),
    [
        ("no", False, (False, False), None),
        ("16-mixed", True, (True, False), "fp16"),
        ("bf16", False, (False, True), "bf16"),
        ("auto", True, (False, False), None),  # may pick fp16
        ("bf16-pure", False, (False, False), None),
        ("fp16:fp32_ops=norm", True, (True, False), None),
        ("bf16:fp32_ops=attention", False, (False, True), None),
    ],
)
def test_the_registry_answers_what_callers_asked_of_name_strings(name, scales, flags, fmt):
    assert hf_flags(name) == flags
    p = make_precision(name, "cpu")  # the object gives the same answers
    assert p.may_scale_loss is scales and p.hf_flags == flags
    assert (autocast_format(p).name if autocast_format(p) is not None else None) == fmt


def test_the_autocast_modes_a_diagnosis_judges_carry_their_facts_not_a_name_to_look_them_up_by():
    # issue 35: the diagnosis works from these objects, not from a table keyed by precision name
    fp16, bf16 = autocast_modes(torch.device("cpu"))  # fp16 first: the order a diagnosis tries them
    assert (fp16.format.max, fp16.format.loss_scaled) == (65504.0, True)
    assert bf16.format.loss_scaled is False and bf16.format.max > 3e38
    for mode, dtype in ((fp16, torch.float16), (bf16, torch.bfloat16)):
        assert mode.unsupported is None  # the CPU runs both
        assert mode.precision.compute_dtype == dtype == mode.format.dtype
        assert autocast_format(mode.precision) == mode.format
        assert mode.name == mode.precision.name  # the label the report prints


def test_mixprec_train_parses_the_precision_once_and_the_accelerator_runs_that_object(tmp_path, monkeypatch):
    from mixprec.cli import _common
    from mixprec.cli import train as train_cli
    from mixprec.cli.main import main

    made: list = []
    parses_after: list[str] = []
    make, canonical = registry.make_precision, registry.canonical_name

    def spy_make(*a, **kw):
        made.append(make(*a, **kw))
        return made[-1]

    def spy_canonical(name):
        if made:
            parses_after.append(name)
        return canonical(name)

    ran: list = []
    original = Accelerator.prepare_model

    def spy_prepare(self, *a, **kw):
        ran.append(self.precision)
        return original(self, *a, **kw)

    monkeypatch.setattr(_common, "make_precision", spy_make)
    monkeypatch.setattr(registry, "canonical_name", spy_canonical)
    monkeypatch.setattr(Accelerator, "prepare_model", spy_prepare)
    monkeypatch.setattr(train_cli, "SAMPLE_BYTES", 8)
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "c.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = [
            "train",
            "--data",
            str(corpus),
            "--model",
            "tiny",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--epoch-tokens",
            "128",
            "--max-steps",
            "1",
            "--precision",
            "bf16-mixed",
            "--fp32-ops",
            "norm",
            "--output-dir",
            str(tmp_path / "run"),
        ]
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert len(made) == 1 and made[0].name == "bf16:fp32_ops=norm"  # parsed once, at the edge
    assert ran and all(p is made[0] for p in ran)  # the Trainer's Accelerator ran that very object
    assert parses_after == []  # and no layer below parsed the name again
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["precision"] == "bf16:fp32_ops=norm"
