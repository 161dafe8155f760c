"""Per-op-kind timing: the policy follows the measured winners, and the measurement sees the model's own
calls (issue 23)."""

from __future__ import annotations

import pytest
import torch

from mixprec.models import GPT, GPTConfig
from mixprec.precision.op_policy import OP_KINDS
from mixprec.precision.op_timing import (
    KindTiming,
    OpTimingReport,
    measure_op_kinds,
    policy_candidate,
    policy_from_timings,
)
from mixprec.precision.registry import canonical_name, resolve_precision


def test_the_issue_s_cpu_figures_keep_attention_in_fp32():
    # issue 23's Zen 4 figures: bf16 matmuls 2x fp32's, bf16 SDPA backward ~4x slower than fp32's
    timings = [KindTiming("linear", 17, 30.0, 60.0), KindTiming("attention", 4, 48.0, 12.4)]
    assert policy_from_timings("bf16", timings) == "bf16:fp32_ops=attention"


def test_every_kind_faster_in_low_precision_is_the_base_mode_itself():
    timings = [KindTiming("linear", 4, 1.0, 2.0), KindTiming("attention", 2, 1.0, 3.0)]
    assert policy_from_timings("bf16", timings) == "bf16"  # a GPU where uniform bf16 wins: nothing changes


def test_a_tie_stays_with_autocast_and_the_margin_decides_what_a_tie_is():
    within = KindTiming("norm", 9, 2.0, 1.93)  # fp32 3.5% faster: inside the 5% margin
    beyond = KindTiming("activation", 4, 1.0, 0.90)  # fp32 10% faster
    assert policy_from_timings("fp16", [within, beyond]) == "fp16:fp32_ops=activation"
    assert policy_from_timings("fp16", [within, beyond], margin=0.0) == "fp16:fp32_ops=norm,activation"


def test_a_kind_whose_fp32_saving_is_immaterial_stays_with_autocast_so_fresh_races_name_one_policy():
    # the main job: embedding 20% faster in fp32 but 0.1 ms of a ~100 ms step; it flipped on noise alone
    timings = (
        KindTiming("linear", 17, 60.0, 120.0),
        KindTiming("attention", 4, 48.0, 12.0),
        KindTiming("embedding", 2, 0.5, 0.4),
    )
    policy = policy_from_timings("bf16", timings)
    assert policy == "bf16:fp32_ops=attention"
    embedding = next(
        line
        for line in OpTimingReport("bf16", "cpu", timings, policy, 1.0).explain().splitlines()
        if line.strip().startswith("embedding")
    )
    assert embedding.endswith("bf16 (fp32 would save < 2% of the step)")


def test_the_report_shows_both_timings_and_the_choice_per_kind():
    timings = (KindTiming("linear", 17, 30.0, 60.0), KindTiming("attention", 4, 48.0, 12.4))
    report = OpTimingReport("bf16", "cpu", timings, policy_from_timings("bf16", timings), 1.2)
    text = report.explain()
    assert "attention" in text and "48.00" in text and "12.40" in text
    assert text.splitlines()[-1].strip() == "policy: bf16:fp32_ops=attention"
    assert [line.split()[-1] for line in text.splitlines()[2:4]] == ["bf16", "fp32"]


def test_measurement_records_the_model_s_own_calls_and_builds_a_runnable_policy():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    report = measure_op_kinds(lambda: model(ids, labels=ids).loss, "cpu", budget_s=0.2)
    calls = {t.kind: t.calls for t in report.timings}
    assert calls["attention"] == 2  # one SDPA per layer, deduplicated into one timed entry
    assert set(calls) <= set(OP_KINDS) and {"linear", "norm", "softmax", "embedding"} <= set(calls)
    assert all(t.low_ms > 0 and t.fp32_ms > 0 for t in report.timings)
    assert canonical_name(report.policy) == report.policy  # a name every level accepts
    resolve_precision(report.policy, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model is not trained
    assert all(p.grad is None for p in model.parameters())


def test_a_base_without_autocast_is_refused_by_name():
    with pytest.raises(ValueError, match=r"measure_op_kinds\(base='fp32'\): choose one of bf16, fp16"):
        measure_op_kinds(lambda: None, "cpu", base="fp32")


def test_the_race_gets_the_policy_as_a_candidate_only_when_it_differs_from_the_base():
    timings = (KindTiming("linear", 17, 30.0, 60.0), KindTiming("attention", 4, 48.0, 12.4))
    report = OpTimingReport("bf16", "cpu", timings, policy_from_timings("bf16", timings), 1.2)
    candidate = policy_candidate(report, "cpu")
    assert candidate.name == "bf16:fp32_ops=attention" and not candidate.pending
    assert "per-op-kind timing" in candidate.reason
    uniform = OpTimingReport("bf16", "cpu", timings[:1], "bf16", 0.5)
    assert policy_candidate(uniform, "cpu") is None


@pytest.mark.parametrize(("attention_bf16_ms", "left_out"), [(3.2, False), (5.0, True)])
def test_the_base_mode_is_left_out_of_the_race_only_when_its_policy_saves_a_large_share(attention_bf16_ms, left_out):
    # linear 10 ms in bf16 (20 in fp32), attention 2 ms in fp32: keeping attention in fp32 saves 1.2 of 13.2 ms
    # (9%: bf16 might still win on the casts the policy adds, so it races) or 3.0 of 15.0 ms (20%: it cannot)
    timings = (KindTiming("linear", 1, 10.0, 20.0), KindTiming("attention", 1, attention_bf16_ms, 2.0))
    report = OpTimingReport("bf16", "cpu", timings, policy_from_timings("bf16", timings), 0.01)
    assert report.policy == "bf16:fp32_ops=attention"  # the policy exists either way
    reason = report.base_dominated()
    assert bool(reason) == left_out
    if left_out:
        assert reason.startswith("the per-op-kind timing put its attention at 5.0 ms against 2.0 ms in fp32 (20%")
