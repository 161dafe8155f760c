"""bf16 stagnation (mixprec.watch.stagnation): updates that round away are measured per layer and warned about.

The planted case: the built-in GPT at a small learning rate (1e-5). With its weights held in bf16 and updated
with round-to-nearest (``model.to(torch.bfloat16)`` + ``Bf16AdamW(rounding="nearest")`` under bf16-pure: bf16-pure
without its stochastic rounding or Kahan summation), most updates are below half a bf16 ulp of the weight and vanish:
the loss barely moves while fp32's falls. The watch must say so within the first 100 steps at its default
interval, and the Kahan variant (``bf16-pure-kahan``) must bring the stagnant fraction to about zero.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from mixprec.models import GPT
from mixprec.optim import Bf16AdamW
from mixprec.watch import DEFAULT_EVERY
from mixprec.watch.stagnation import StagnationProbe, StagnationWarning, stagnant_fractions
from planted_text import random_batch

LR = 1e-5
STEPS = 100
BATCH, SEQ = 8, 32


def _train(precision: str, *, bf16_weights: bool = False, steps: int = STEPS, every: int = DEFAULT_EVERY):
    torch.manual_seed(0)
    model = GPT.from_preset("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if bf16_weights:
        # bf16 weights stepped with round-to-nearest: under "no"/"bf16" a trainable bf16 parameter now gets an
        # fp32 master (precision/master_weights.py), so the stalling update is bf16-pure's with nearest rounding
        model = model.to(torch.bfloat16)
        opt = Bf16AdamW(model.parameters(), lr=LR, rounding="nearest")
    acc = Accelerator(mixed_precision=precision, cpu=True, watch={"every": every}, verbose=False)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = random_batch(g, BATCH, SEQ)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    acc.watch.close()
    return losses, acc.watch


def _drop(losses: list[float]) -> float:
    return sum(losses[:10]) / 10 - sum(losses[-10:]) / 10


def _stagnation(watch) -> list[StagnationWarning]:
    return [w for w in watch.numerics_warnings if isinstance(w, StagnationWarning)]


@functools.cache
def _round_to_nearest_run():
    return _train("bf16-pure", bf16_weights=True)


def test_a_stalled_bf16_run_is_warned_within_100_steps_while_fp32_learns():
    fp32_losses, fp32_watch = _train("fp32")
    bf16_losses, bf16_watch = _round_to_nearest_run()
    assert _drop(fp32_losses) > 0.1  # fp32 learns at this learning rate...
    assert _drop(bf16_losses) < 0.4 * _drop(fp32_losses)  # ...the bf16 weights mostly do not
    warned = _stagnation(bf16_watch)
    assert warned and all(w.step <= 100 for w in warned)
    assert {w.layer for w in warned} >= {"transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_attn"}
    assert all(w.dtype == "bfloat16" and w.stagnant >= 0.5 for w in warned)
    assert "rounding='kahan'" in warned[0].message() and "fp32 master" in warned[0].message()
    assert not _stagnation(fp32_watch)
    assert max(fp32_watch.numerics[-1]["stagnant"].values()) < 0.01


def test_the_advice_under_nearest_rounding_follows_the_optimizer_in_use():
    # issue 34: bf16-pure with Bf16AdamW(rounding="nearest") was said to update "with stochastic rounding" and
    # told to use precision='bf16-pure', the mode in use
    _, watch = _round_to_nearest_run()
    message = _stagnation(watch)[0].message()
    assert "rounds each update to nearest" in message
    assert "'bf16-pure'" not in message and "stochastic rounding" not in message
    assert "rounding='stochastic'" in message and "rounding='kahan'" in message
    assert all("'bf16-pure'" not in line for line in watch.summary_lines())


def test_kahan_summation_brings_the_stagnant_fraction_to_about_zero():
    _, nearest = _round_to_nearest_run()
    _, kahan = _train("bf16-pure-kahan", steps=60, every=30)
    nearest_mean = _mean(nearest.numerics[-1]["stagnant"])
    kahan_mean = _mean(kahan.numerics[-1]["stagnant"])
    assert nearest_mean > 0.5
    assert kahan_mean < 0.05  # the bf16 compensation buffer itself loses a little on weights near 1 (LayerNorm)
    assert not _stagnation(kahan)


def test_stochastically_rounded_parameters_are_not_counted_as_stagnant():
    # one step in expectation: most elements stay put on a given step, yet nothing is lost on average
    _, watch = _train("bf16-pure", steps=4, every=2)
    assert all(entry["stagnant"] == {} for entry in watch.numerics)
    assert not _stagnation(watch)


def _mean(fractions: dict[str, float]) -> float:
    return sum(fractions.values()) / len(fractions)


# -- the probe on its own ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lr", "expected"), [(1e-6, 1.0), (1e-1, 0.0)])
def test_the_probe_counts_the_elements_an_update_did_not_move(lr, expected):
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).to(torch.bfloat16)
    nn.init.constant_(layer.weight, 1.0)  # bf16 ulp at 1.0 is 2^-7: 1e-6 rounds away, 0.1 does not
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    probe = StagnationProbe(nn.Sequential(layer))
    probe.watch_optimizer(opt)
    probe.arm()
    layer(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    fractions = stagnant_fractions({k: v.tolist() for k, v in probe.finish().items()})
    assert fractions == {"0": expected}


def test_an_unarmed_probe_measures_nothing():
    layer = nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    probe = StagnationProbe(layer)
    probe.watch_optimizer(opt)
    layer(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert probe.finish() == {}


def test_a_group_with_no_learning_rate_is_not_stagnant_and_fp32_weights_get_fp32s_advice():
    # a frozen group (lr 0) was "not learning: its updates round away in float32", and fp32 weights were told
    # to get fp32 masters
    from mixprec.watch.stagnation import StagnationWarning

    layer = nn.Linear(4, 4)
    opt = torch.optim.SGD([{"params": [layer.weight], "lr": 0.0}, {"params": [layer.bias], "lr": 1e-3}])
    probe = StagnationProbe(nn.Sequential(layer))
    probe.watch_optimizer(opt)
    probe.arm()
    layer(torch.ones(1, 4)).sum().backward()
    opt.step()
    counts = probe.finish()
    assert {k: v.tolist() for k, v in counts.items()} == {"0": [0.0, 4.0]}  # the bias alone: it moved
    said = StagnationWarning("wte", 1, 1.0, "float32", fixes="prepare the optimizer with the Accelerator").message()
    assert "fp32 already" in said and "Accelerator" not in said
