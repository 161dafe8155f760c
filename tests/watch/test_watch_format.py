"""The watch measures a run against the format it computes in, as the run's precision answers it (issue 34:
the format was looked up by the mode's name, so a bf16 policy, bf16-pure and bf16-pure-kahan were judged by
fp16's range and told they were "running out of fp16 range")."""

from __future__ import annotations

import logging

import pytest
import torch

from mixprec import Accelerator
from mixprec.models import GPT
from mixprec.precision.formats import BF16, FP16
from planted_text import random_batch

# warn_headroom far above any format's: every sampled layer warns, so the warnings' text is checked
WATCH = {"every": 1, "warn_headroom": 500.0}


def _watched(precision: str, steps: int = 2):
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accelerator(mixed_precision=precision, cpu=True, watch=WATCH, verbose=False)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = random_batch(g, 2, 16)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    acc.watch.close()
    return acc.watch


@pytest.mark.parametrize("precision", ["bf16:fp32_ops=attention", "bf16-pure", "bf16-pure-kahan", "bf16"])
def test_a_bf16_run_is_measured_against_bf16s_range(precision, caplog):
    with caplog.at_level(logging.WARNING, logger="mixprec.watch"):
        watch = _watched(precision)
    assert watch.fmt is BF16
    assert watch.samples and {s.fmt for s in watch.samples} == {"bf16"}
    assert watch.warnings and all(w.fmt == "bf16" for w in watch.warnings)
    assert "bf16 range" in caplog.text and "fp16" not in caplog.text
    assert watch.summary()["format"] == "bf16"


def test_an_fp16_policy_is_measured_against_fp16s_range():
    watch = _watched("fp16:fp32_ops=attention")
    assert watch.fmt is FP16 and {s.fmt for s in watch.samples} == {"fp16"}


def test_auto_is_measured_against_its_narrowest_candidate_then_against_its_choice():
    from mixprec.precision.decision import AutoDecision

    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accelerator(mixed_precision="auto", cpu=True, watch=WATCH, verbose=False)
    model, opt = acc.prepare(model, opt)
    narrowest = min((p.compute_format for p in acc.precision.options()), key=lambda f: f.max)
    assert not acc.precision.decided and acc.watch.fmt is narrowest
    # a recorded decision (as a resumed run adopts it): no race, the run computes in bf16 from here on
    acc.precision.adopt(AutoDecision(chosen="bf16", step_seconds={}, device="cpu", source="checkpoint"))
    ids = random_batch(torch.Generator().manual_seed(1), 2, 16)
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    acc.watch.close()
    assert acc.watch.fmt is BF16
