"""Every precision answers its own facts (issue 34/35): the format it computes in and its range, whether it scales
the loss, keeps fp32 master weights, how its optimizer rounds the update, its HF flags and autocast arguments.

Callers (the watch, the diagnosis, TrainingArguments) ask these instead of comparing the mode's name, so each
registered mode, a per-op policy and "auto" are held to them here."""

from __future__ import annotations

import pytest
import torch

from mixprec import Accelerator
from mixprec.optim import Bf16AdamW
from mixprec.precision.formats import BF16, FP16, FP32, format_of
from mixprec.precision.registry import available_precisions, canonical_name, make_precision

# name: (format, scales the loss, fp32 master weights, update rounding, HF's (fp16, bf16) flags)
EXPECTED = {
    "fp32": (FP32, False, True, "nearest", (False, False)),
    "fp16": (FP16, True, True, "nearest", (True, False)),
    "bf16": (BF16, False, True, "nearest", (False, True)),
    "bf16-pure": (BF16, False, False, "stochastic", (False, False)),
    "bf16-pure-kahan": (BF16, False, False, "kahan", (False, False)),
    "fp8": (BF16, False, True, "nearest", (False, False)),  # fp8 Linears, bf16 autocast for the rest
    "fp8-rowwise": (BF16, False, True, "nearest", (False, False)),
    "bf16:fp32_ops=attention": (BF16, False, True, "nearest", (False, True)),
    "fp16:fp32_ops=attention,norm,softmax": (FP16, True, True, "nearest", (True, False)),
}
REGISTERED = list(dict.fromkeys(canonical_name(n) for n in available_precisions() if n != "auto"))


def test_every_registered_mode_is_held_to_the_facts():
    assert set(REGISTERED) <= set(EXPECTED), f"a new mode needs its facts here: {set(REGISTERED) - set(EXPECTED)}"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_mode_answers_its_facts(name, monkeypatch):
    monkeypatch.setenv("MIXPREC_FP8_EMULATE", "1")  # fp8 has no CPU matmuls: torchao's emulation (tests only)
    if name.startswith("fp8"):
        pytest.importorskip("torchao")
    p = make_precision(name, "cpu")
    fmt, scales, masters, rounding, flags = EXPECTED[name]
    assert p.compute_format is fmt and p.compute_format.dtype == p.compute_dtype
    assert p.needs_loss_scaling is scales and p.compute_format.loss_scaled is scales
    assert p.master_weights is masters and p.grad_dtype == p.param_dtype
    assert p.update_rounding == rounding
    assert p.hf_flags == flags
    assert p.decided
    kwargs = p.autocast_kwargs()
    assert kwargs == {"device_type": "cpu", "dtype": p.compute_dtype, "enabled": fmt is not FP32}
    described = p.describe()
    assert described["master_weights"] is masters and described["update_rounding"] == rounding


def test_auto_answers_for_its_current_mode_and_says_it_is_undecided():
    auto = make_precision("auto", "cpu")
    assert not auto.decided
    assert auto.compute_format is FP32  # it runs its safest candidate until the race
    assert auto.hf_flags == (False, False) and auto.update_rounding == "nearest"
    bf16 = make_precision("bf16", "cpu")
    auto.adopt(auto_decision_for(auto, bf16.name))
    assert auto.decided and auto.compute_format is BF16 and auto.hf_flags == (False, True)


def auto_decision_for(auto, name):
    from mixprec.precision.decision import AutoDecision

    return AutoDecision(chosen=name, step_seconds={}, device="cpu", source="checkpoint")


def test_a_format_no_precision_computes_in_is_an_error_not_a_default():
    with pytest.raises(ValueError, match="no number format is described for torch.float64"):
        format_of(torch.float64)


def test_pure_bf16_reports_the_rounding_of_the_optimizer_it_was_given():
    # issue 34: bf16-pure with the user's Bf16AdamW(rounding="nearest") said "updates with stochastic rounding"
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    acc = Accelerator(mixed_precision="bf16-pure", cpu=True, verbose=False)
    acc.prepare(model, Bf16AdamW(model.parameters(), lr=1e-3, rounding="nearest"))
    assert acc.precision.update_rounding == "nearest"
    assert "stochastic" not in acc.precision.reason and "rounded to nearest" in acc.precision.reason
    assert "stochastic" not in acc.precision.describe()["update"]


def test_pure_bf16_that_makes_its_own_optimizer_reports_its_rounding():
    model = torch.nn.Linear(4, 4)
    acc = Accelerator(mixed_precision="bf16-pure-kahan", cpu=True, verbose=False)
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert acc.precision.update_rounding == "kahan" and "Kahan" in acc.precision.reason
