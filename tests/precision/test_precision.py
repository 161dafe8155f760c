"""The precision registry: every name parses to the right strategy, "auto" explains itself, and a mode the
device cannot run is refused with what to use instead, never silently run as something else."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.precision import (
    Bf16MixedPrecision,
    Fp16MixedPrecision,
    FullPrecision,
    PrecisionNotSupportedError,
    available_precisions,
    canonical_name,
    resolve_precision,
)
from mixprec.precision import probe as probe_module
from mixprec.precision.probe import ProbeResult

NAMES = {
    FullPrecision: ["no", "fp32", "32", "float32", "32-true", "FP32", " no "],
    Fp16MixedPrecision: ["fp16", "16", "float16", "half", "16-mixed", "fp16-mixed", "FP16"],
    Bf16MixedPrecision: ["bf16", "bfloat16", "bf16-mixed", "BF16"],
}


@pytest.mark.parametrize(
    "name, cls", [(name, cls) for cls, names in NAMES.items() for name in names], ids=lambda v: repr(v)
)
def test_every_name_and_alias_resolves_to_its_strategy(name, cls):
    p = resolve_precision(name, "cpu")
    assert type(p) is cls
    assert canonical_name(name) == cls.name
    assert p.device == torch.device("cpu")


def test_the_public_names_are_the_documented_ones():
    names = available_precisions()
    assert names[:4] == ["no", "fp32", "fp16", "bf16"] and names[-1] == "auto"
    assert {"bf16-pure", "bf16-pure-kahan"} <= set(names)
    assert {"fp8", "fp8-rowwise"} <= set(names)
    assert mixprec.resolve_precision is resolve_precision


@pytest.mark.parametrize("name", ["fp17", "", "mixed", "bf17-pure"])
def test_unknown_name_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match=r"unknown precision .*choose one of: no, fp32, fp16, bf16, .*auto"):
        resolve_precision(name, "cpu")


def test_a_non_string_name_is_a_type_error():
    with pytest.raises(TypeError, match="precision must be a string"):
        resolve_precision(16, "cpu")


def test_strategies_state_what_the_mode_means():
    fp32, fp16, bf16 = (resolve_precision(n, "cpu") for n in ("fp32", "fp16", "bf16"))
    assert (fp32.compute_dtype, fp16.compute_dtype, bf16.compute_dtype) == (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    assert [p.needs_loss_scaling for p in (fp32, fp16, bf16)] == [False, True, False]
    assert fp16.reason == "fp16 was asked for"


# -- auto ------------------------------------------------------------------------------------------------


def test_bare_auto_on_cpu_says_it_guessed_from_the_stand_in_probe():
    # No training step to measure here: the reason must not pass a stand-in off as a measurement of the model.
    p = resolve_precision("auto", "cpu")
    result = probe_module.cpu_probe()
    assert p.name == result.chosen in {"fp32", "bf16", "fp16"}
    assert "measured a training-step probe" in p.reason
    for name, speedup in result.speedups().items():
        assert f"{name} {speedup:.2f}x" in p.reason
    assert p.reason == f"{result.explain()} (guessed without a training step to measure: a stand-in for your model)"


def _planted(fp32: float, bf16: float, fp16: float, chosen: str = "") -> ProbeResult:
    seconds = {"fp32": fp32, "bf16": bf16, "fp16": fp16}
    return ProbeResult(seconds, chosen or probe_module.choose(seconds), cost_seconds=0.1)


@pytest.mark.parametrize(
    "fp32, bf16, fp16, expected",
    [
        (1.0, 4.0, 5.0, "fp32"),  # this CPU: emulated low precision, several times slower
        (1.0, 0.5, 0.7, "bf16"),
        (1.0, 0.8, 0.5, "fp16"),
        (1.0, 0.6, 0.6, "bf16"),  # a tie goes to bf16: no loss scaling needed
        (1.0, 0.6, 0.58, "bf16"),  # fp16 must win by the margin, not by noise
        (1.0, 0.97, 0.96, "fp32"),  # within the margin of fp32: the safer mode
    ],
)
def test_choose_prefers_the_fastest_by_a_margin(fp32, bf16, fp16, expected):
    assert probe_module.choose({"fp32": fp32, "bf16": bf16, "fp16": fp16}) == expected


def test_a_median_win_that_the_best_times_contradict_is_not_taken():
    # What a busy machine produces: fp32's steps wait for descheduled threads, so its median looks slow,
    # while its best step shows the emulated bf16 is 10x slower. Noise only adds time: trust the minimum too.
    medians = {"fp32": 0.30, "bf16": 0.27, "fp16": 0.40}
    minima = {"fp32": 0.005, "bf16": 0.05, "fp16": 0.07}
    assert probe_module.choose(medians) == "bf16"  # what a median-only probe chose
    assert probe_module.choose(medians, minima) == "fp32"
    real_win = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.9}, {"fp32": 0.9, "bf16": 0.4, "fp16": 0.8}
    assert probe_module.choose(*real_win) == "bf16"  # a real win (AMX, say) still wins


def test_auto_never_picks_a_mode_slower_than_fp32_by_the_probes_numbers():
    rng = torch.Generator().manual_seed(0)
    for _ in range(500):
        seconds = dict(zip(("fp32", "bf16", "fp16"), (torch.rand(3, generator=rng) * 2 + 0.01).tolist()))
        best = {name: t * float(torch.rand((), generator=rng)) for name, t in seconds.items()}
        chosen = probe_module.choose(seconds, best)
        assert seconds[chosen] <= seconds["fp32"] and best[chosen] <= best["fp32"]
        if chosen != "fp32":
            assert seconds[chosen] < seconds["fp32"] * (1 - probe_module.MARGIN)
            assert best[chosen] < best["fp32"]


def test_auto_uses_the_probe_result(monkeypatch):
    monkeypatch.setattr(probe_module, "cpu_probe", lambda: _planted(1.0, 0.5, 0.9))
    p = resolve_precision("auto", "cpu")
    assert type(p) is Bf16MixedPrecision
    assert "bf16 2.00x" in p.reason and "chose bf16" in p.reason


def test_auto_on_cuda_prefers_bf16_then_fp16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, expected in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, s=supported: s)
        p = resolve_precision("auto", "cuda")
        assert p.name == expected and p.reason.startswith("auto on cuda guessed")


def test_auto_on_a_device_without_autocast_is_fp32_and_says_why():
    p = resolve_precision("auto", "meta")
    assert type(p) is FullPrecision
    assert "no autocast" in p.reason


# -- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_device_without_autocast_refuses_mixed_modes_and_names_fp32(name):
    with pytest.raises(PrecisionNotSupportedError, match=r"no autocast for device type 'meta'.*precision='fp32'"):
        resolve_precision(name, "meta")
    assert issubclass(PrecisionNotSupportedError, ValueError)
    assert type(resolve_precision("fp32", "meta")) is FullPrecision  # the alternative it names does run


def test_bf16_on_a_gpu_without_bf16_is_refused_not_downgraded(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(PrecisionNotSupportedError, match=r"'Tesla T4' has no native bf16.*precision='fp16'"):
        resolve_precision("bf16", "cuda")
    assert type(resolve_precision("fp16", "cuda")) is Fp16MixedPrecision


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "auto"])
def test_cuda_requested_without_cuda_is_refused(name):
    # torch.device("cuda") constructs fine here; the strategy must not (nor claim "this GPU has no bf16")
    with pytest.raises(PrecisionNotSupportedError, match=r"CUDA is not available.*device='cpu'"):
        resolve_precision(name, "cuda")


def test_an_explicit_mode_runs_as_itself():
    # No silent downgrade: what was asked for is what the matmuls run in.
    lin = torch.nn.Linear(4, 4)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        p = resolve_precision(name, "cpu")
        with p.autocast():
            assert lin(torch.ones(1, 4)).dtype is dtype
