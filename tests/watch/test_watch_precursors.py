"""Instability precursors (mixprec.watch.precursors) and the built-in GPT's z-loss and attention-logit max.

The planted case: the built-in GPT with AdamW whose learning rate warms up to 1.0 (far too high). Its
attention logits grow by orders of magnitude within the first steps, and tens of steps later the loss spikes.
The watch must warn, with the remedies, at least 10 steps before the spike; the same run at a sane learning
rate must not be warned about.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mixprec import Accelerator
from mixprec.models import GPT, GPTConfig
from mixprec.watch import WatchConfig
from mixprec.watch.numerics import NumericsChecks
from mixprec.watch.precursors import InstabilityWarning, PrecursorJudge
from planted_text import random_batch

BATCH, SEQ = 8, 32
WARMUP = 80
EVERY = 5


def _train(peak_lr: float, steps: int):
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    acc = Accelerator(mixed_precision="fp32", cpu=True, watch={"every": EVERY}, verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = peak_lr * min(1.0, (step + 1) / WARMUP)
        ids = random_batch(g, BATCH, SEQ)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    acc.watch.close()
    return losses, acc.watch


def _spike(losses: list[float], factor: float = 1.5) -> int | None:
    """The step (1-based, as the watch counts) the run diverges at: from it on, every loss exceeds ``factor`` x
    the lowest loss before it. (A bump the run recovers from, as early in a warm-up, is not divergence.)"""
    for i in range(1, len(losses)):
        if all(loss > factor * min(losses[:i]) for loss in losses[i:]):
            return i + 1
    return None


def _precursors(watch) -> list[InstabilityWarning]:
    return [w for w in watch.numerics_warnings if isinstance(w, InstabilityWarning)]


def test_a_diverging_run_is_warned_at_least_10_steps_before_its_loss_spikes():
    losses, watch = _train(peak_lr=1.0, steps=70)
    spike = _spike(losses)
    assert spike is not None, "the planted run must diverge"
    warned = _precursors(watch)
    assert warned, "no precursor warning"
    first = min(w.step for w in warned)
    assert first <= spike - 10
    attention = next(w for w in warned if w.signal == "attention_logit")
    assert attention.where.startswith("transformer.h.") and attention.value > 100
    assert "qk-layernorm" in attention.message() and "lower the learning rate" in attention.message()


def test_a_stable_run_raises_no_precursor_warning():
    losses, watch = _train(peak_lr=3e-3, steps=40)
    assert _spike(losses) is None
    assert not _precursors(watch)
    readings = watch.numerics[-1]
    assert 0 < readings["attn:transformer.h.0.attn"] < 100  # read on the sampled steps...
    assert abs(readings["log_z"] - watch.numerics[0]["log_z"]) < 3  # ...and the output's log Z with them


def test_log_partition_drift_is_measured_from_the_first_sample():
    judge = PrecursorJudge(attn_logit_warn=100, log_z_drift_warn=3)
    assert judge.update(10, {"log_z": 5.5}) == []
    assert judge.update(20, {"log_z": 7.0}) == []
    (warning,) = judge.update(30, {"log_z": 9.0})
    assert (warning.signal, warning.baseline, warning.value) == ("log_partition", 5.5, 9.0)
    assert "z-loss of 1e-4" in warning.message()
    assert judge.update(40, {"log_z": 20.0}) == []  # once per run


# -- the GPT's side: attention-logit max and z-loss ---------------------------------------------------------


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def test_attention_keeps_the_exact_largest_logit_only_when_asked():
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    attn = model.transformer.h[0].attn
    seen = {}
    attn.c_attn.register_forward_hook(lambda m, a, out: seen.setdefault("qkv", out.detach()))
    model(_ids())
    assert attn.logit_max is None  # off by default: the fused kernel alone
    attn.track_logit_max = True
    seen.clear()
    ids = _ids()
    model(ids)
    q, k, _ = seen["qkv"].split(model.config.n_embd, dim=2)
    heads = model.config.n_head
    q, k = (t.view(2, 16, heads, -1).transpose(1, 2) for t in (q, k))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).amax()
    torch.testing.assert_close(attn.logit_max, expected)


def test_z_loss_adds_its_weight_times_the_mean_squared_log_partition():
    torch.manual_seed(0)
    plain = GPT.from_preset("tiny")
    with_z = GPT.from_preset("tiny", z_loss=1e-4)
    with_z.load_state_dict(plain.state_dict())
    ids = _ids(1)
    out = plain(ids, labels=ids)
    log_z = torch.logsumexp(out.logits[:, :-1].float(), dim=-1)
    cross_entropy = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    expected = cross_entropy + 1e-4 * log_z.square().mean()
    torch.testing.assert_close(with_z(ids, labels=ids).loss, expected)


@pytest.mark.parametrize("value", [-1e-4, 1.0])
def test_z_loss_out_of_range_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="GPTConfig.z_loss"):
        GPTConfig(z_loss=value)


def test_a_resumed_watch_keeps_the_log_z_baseline_and_what_it_already_warned():
    checks = NumericsChecks(GPT.from_preset("tiny"), WatchConfig())
    assert [w.signal for w in checks.judge.update(100, {"log_z": 5.5, "attn:a": 500.0})] == ["attention_logit"]
    state = json.loads(json.dumps(checks.state_dict()))  # plain values: a weights_only checkpoint holds them
    resumed = NumericsChecks(GPT.from_preset("tiny"), WatchConfig())
    resumed.load_state_dict(state)
    (warning,) = resumed.judge.update(200, {"log_z": 9.0, "attn:a": 900.0})
    assert (warning.signal, warning.baseline) == ("log_partition", 5.5)


def test_the_attention_logit_max_skips_the_keys_padding_hides():
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    attn = model.transformer.h[0].attn
    attn.track_logit_max = True
    seen = {}
    attn.c_attn.register_forward_hook(lambda m, a, out: seen.setdefault("qkv", out.detach()))
    ids = _ids(2)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0  # left padding in the first sequence
    model(ids, attention_mask=mask)
    q, k, _ = seen["qkv"].split(model.config.n_embd, dim=2)
    q, k = (t.view(2, 16, model.config.n_head, -1).transpose(1, 2) for t in (q, k))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    visible = GPT._attention_bias(mask, 2, 16)
    torch.testing.assert_close(attn.logit_max, scores.masked_fill(~visible, float("-inf")).amax())


def test_a_log_partition_falling_towards_0_is_not_a_precursor_but_one_moving_away_is():
    # issue 34: at --lr 0.1 log Z fell from 10.4 to 5.5 while the loss improved, and the watch warned
    falling = PrecursorJudge(attn_logit_warn=100, log_z_drift_warn=3)
    samples = [(5, 10.38), (10, 8.3), (15, 5.47), (20, 0.5)]
    assert [falling.update(step, {"log_z": z}) for step, z in samples] == [[]] * 4
    below = PrecursorJudge(attn_logit_warn=100, log_z_drift_warn=3)
    assert below.update(5, {"log_z": 5.5}) == [] and below.update(10, {"log_z": -2.0}) == []
    (warning,) = below.update(15, {"log_z": -9.0})  # very negative logits: Wortsman et al.'s divergence
    assert (warning.signal, warning.value) == ("log_partition", -9.0)


def test_the_log_partition_advice_follows_the_models_z_loss():
    # issue 34: with --z-loss 1e-4 set the warning still said "add a z-loss of 1e-4 (GPTConfig(...))"
    def warning_for(model):
        checks = NumericsChecks(model, WatchConfig())
        assert checks.judge.update(5, {"log_z": 5.5}) == []
        (warning,) = checks.judge.update(10, {"log_z": 12.0})
        return warning.message()

    with_z = warning_for(GPT.from_preset("tiny", z_loss=1e-4))
    assert "already on (0.0001)" in with_z and "--z-loss 0.001" in with_z and "add a z-loss" not in with_z
    without = warning_for(GPT.from_preset("tiny"))
    assert "add a z-loss of 1e-4" in without and "mixprec train --z-loss 1e-4" in without


def test_a_skipped_steps_nan_log_partition_is_its_overflow_not_a_precursor(monkeypatch):
    # an fp16 forward overflow (a skipped step) read log Z as nan and advised a z-loss, using up the run's one
    # log-partition warning before any real drift
    checks = NumericsChecks(GPT.from_preset("tiny"), WatchConfig())
    monkeypatch.setattr(checks.stagnation, "finish", lambda: {})
    monkeypatch.setattr(checks.precursors, "finish", lambda: {"log_z": torch.tensor(float("nan"))})
    entry, _, warnings = checks.finish(2, skipped=True)
    assert warnings == [] and math.isnan(entry["log_z"]) and "log_partition" not in checks.judge.warned
    _, _, warnings = checks.finish(3, skipped=False)  # a step that ran and still read nan: said
    assert [w.signal for w in warnings] == ["log_partition"]
