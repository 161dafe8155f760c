"""One contract for every registered precision strategy.

The list comes from the registry, so a new mode ("bf16-pure", "fp8") is held to the same invariants the day
it is registered, without anyone editing this file."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch

from conftest import TinyOutput, make_batches, make_tiny_lm
from mixprec.precision.registry import available_precisions, canonical_name, resolve_precision

# canonical names only: aliases ("no") and "auto" resolve to one of these
STRATEGIES = list(dict.fromkeys(canonical_name(n) for n in available_precisions() if n != "auto"))
# per-op-kind policies are spelled, not registered: held to the same contract (issue 23)
STRATEGIES += ["bf16:fp32_ops=attention", "fp16:fp32_ops=attention,norm,softmax"]


def test_the_registry_lists_the_modes_we_ship():
    assert {"fp32", "fp16", "bf16"} <= set(STRATEGIES)


@pytest.fixture(params=STRATEGIES)
def precision(request, monkeypatch):
    # fp8 has no matmuls on a CPU: its contract is checked through torchao's emulation (a test-only switch)
    monkeypatch.setenv("MIXPREC_FP8_EMULATE", "1")
    return resolve_precision(request.param, "cpu")


def test_name_round_trips(precision):
    assert canonical_name(precision.name) == precision.name
    again = resolve_precision(precision.name, "cpu")
    assert type(again) is type(precision)
    assert again.compute_dtype == precision.compute_dtype


def test_parameters_are_held_in_the_declared_dtype(precision, tiny_lm):
    # fp32 master weights for every autocast mode; the pure modes say so and convert
    assert precision.param_dtype == (
        torch.float32
        if precision.compute_dtype != precision.param_dtype or precision.name == "fp32"
        else precision.compute_dtype
    )
    model = precision.convert_module(tiny_lm)
    assert isinstance(model, torch.nn.Module)
    assert all(p.dtype == precision.param_dtype for p in model.parameters())


def test_autocast_runs_matmuls_in_the_compute_dtype(precision):
    lin = torch.nn.Linear(8, 4)
    with precision.autocast():
        out = lin(torch.ones(2, 8))
    assert out.dtype == precision.compute_dtype
    assert lin(torch.ones(2, 8)).dtype == torch.float32  # and only inside the context


class _Pair(NamedTuple):
    a: torch.Tensor
    n: int


class _ModelOutputLike(OrderedDict):
    """The two traits of transformers' ModelOutput that convert_output relies on (importing transformers
    costs seconds): a Mapping with ``to_tuple``."""

    def to_tuple(self):
        return tuple(self.values())


def test_convert_output_gives_fp32(precision):
    lin = torch.nn.Linear(8, 4)
    with precision.autocast():
        y = lin(torch.ones(2, 8))
    ids = torch.arange(3)
    out = precision.convert_output(
        {"y": y, "ids": ids, "nested": [y, (y,)], "pair": _Pair(y, 3), "obj": TinyOutput(loss=y.sum(), logits=y)}
    )
    assert out["y"].dtype == torch.float32
    assert out["ids"] is ids  # integers pass through untouched
    assert out["nested"][0].dtype == out["nested"][1][0].dtype == torch.float32
    assert isinstance(out["pair"], _Pair) and out["pair"].a.dtype == torch.float32 and out["pair"].n == 3
    assert isinstance(out["obj"], TinyOutput) and out["obj"].logits.dtype == torch.float32
    hf = precision.convert_output(_ModelOutputLike(logits=y))
    assert isinstance(hf, _ModelOutputLike) and hf["logits"].dtype == torch.float32
    torch.testing.assert_close(out["y"], y.float())  # a cast, not a recomputation


def test_scaler_is_enabled_exactly_when_loss_scaling_is_needed(precision):
    scaler = precision.make_scaler(init_scale=2.0**8)
    assert scaler.is_enabled() == precision.needs_loss_scaling
    assert scaler.get_scale() == (2.0**8 if precision.needs_loss_scaling else 1.0)


def test_the_seed_loop_trains_with_the_strategys_scaler(precision):
    model = precision.convert_module(make_tiny_lm())
    optimizer = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = precision.make_scaler()
    losses = []
    for batch in make_batches(20):
        inputs, targets = batch["input_ids"], batch["labels"]
        with precision.autocast():
            outputs = model(inputs, labels=targets)
            loss = outputs.loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert scaler.record.steps == 20 and scaler.record.skipped_steps == 0
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4]), losses


def test_describe_is_json_and_says_what_the_mode_is(precision):
    d = json.loads(json.dumps(precision.describe()))
    assert d["precision"] == precision.name
    assert d["compute_dtype"] == str(precision.compute_dtype).removeprefix("torch.")
    assert d["param_dtype"] == str(precision.param_dtype).removeprefix("torch.")
    assert d["loss_scaling"] is precision.needs_loss_scaling
    assert d["device"] == "cpu" and d["reason"]
