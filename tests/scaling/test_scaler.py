"""mixprec.GradScaler: the behaviours a training loop relies on, on CPU.

Tolerances are stated where fp16 enters: fp16 has an 11-bit significand (unit roundoff 2^-11 ~ 4.9e-4), so a
gradient computed from fp16-rounded inputs and fp16-rounded output gradients, accumulated in fp32, is within
a few 1e-4 of fp32; the asserts allow 5e-3 (10x margin). Everything else is exact: the scaler's bookkeeping
has no rounding beyond the fp32 scale itself, which powers of two keep exact.
"""

from __future__ import annotations

import copy
import json
import math
import random
import warnings

import pytest
import torch

import mixprec
from conftest import make_batches, make_tiny_lm
from mixprec import ConsecutiveSkipsError, GradScaler

INF = float("inf")
FP16_RTOL = 5e-3


# -- helpers ---------------------------------------------------------------------------------------------


def seed_loop(model, batches, scaler, optimizer) -> list[float]:
    """The seed's first snippet, verbatim apart from the scaler passed in. Returns the losses."""
    losses = []
    for batch in batches:
        inputs, targets = batch["input_ids"], batch["labels"]

        with torch.autocast(device_type="cpu", dtype=torch.float16):
            outputs = model(inputs, labels=targets)
            loss = outputs.loss

        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def linear(seed: int = 0, n_in: int = 4, n_out: int = 3, dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out).to(dtype)


def one_step(scaler: GradScaler, model: torch.nn.Linear, opt: torch.optim.Optimizer, *, inf: bool = False) -> None:
    """A full-precision step (the scaler's bookkeeping does not depend on autocast); ``inf`` plants an inf
    in one gradient after backward, as an fp16 overflow would."""
    x = torch.linspace(-1, 1, 2 * model.in_features).reshape(2, model.in_features).to(model.weight.dtype)
    loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    if inf:
        model.weight.grad[0, 0] = INF
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def assert_unchanged(before, model, opt) -> None:
    params, opt_state = before
    for old, new in zip(params, model.parameters()):
        assert torch.equal(old, new.detach())
    now = opt.state_dict()["state"]
    assert now.keys() == opt_state["state"].keys()
    for key, state in opt_state["state"].items():
        for name, value in state.items():  # exp_avg, exp_avg_sq, step
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(now[key][name])), name


def device_scale(scaler: GradScaler) -> float:
    """The scale the device really multiplies by, observed through the public scale()."""
    return scaler.scale(torch.ones(())).item()


# -- the seed's first snippet ----------------------------------------------------------------------------


def test_seed_snippet_trains_with_loss_scaling_on_cpu():
    model = make_tiny_lm()
    scaler = mixprec.GradScaler()  # no device argument, as in the seed
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = seed_loop(model, make_batches(30), scaler, optimizer)

    assert scaler.is_enabled()
    assert scaler.get_scale() > 1.0
    assert scaler.record.steps == 30 and scaler.record.skipped_steps == 0
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses


@pytest.mark.skipif(torch.cuda.is_available(), reason="documents the CPU-only behaviour of torch's scaler")
def test_torch_default_scaler_disables_itself_on_a_cpu_only_machine():
    # Why mixprec exists: the seed's `torch.amp.GradScaler()` defaults to CUDA and quietly turns off here,
    # so fp16 trains with no loss scaling at all.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler()
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0


# -- underflow: the reason loss scaling exists --------------------------------------------------------------


def _regression_run(mode: str, steps: int = 5) -> tuple[torch.Tensor, torch.Tensor, list[float], list[torch.Tensor]]:
    """Linear regression with a loss weight of 1e-9: d loss / d output ~ 1e-9, below fp16's smallest
    subnormal (2^-24 ~ 6e-8), so under fp16 autocast the Linear's output gradient rounds to exactly 0."""
    g = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(32, 8, generator=g), torch.randn(4, 8, generator=g)
    y = x @ w_true.T
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4, bias=False)
    init = lin.weight.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=1e7)  # the true gradients are ~1e-8: a step of ~0.1
    scaler = GradScaler(enabled=(mode == "fp16+scaler"))
    losses, grads = [], []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16, enabled=(mode != "fp32")):
            out = lin(x)
        loss = 0.5e-9 * (out.float() - y).square().sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads.append(lin.weight.grad.clone())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return init, lin.weight.detach(), losses, grads


def test_tiny_gradients_vanish_in_fp16_without_scaling():
    init, final, losses, grads = _regression_run("fp16")
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # exactly zero, not merely small
    assert torch.equal(init, final)  # learned nothing
    assert losses[-1] == losses[0]


def test_loss_scaling_recovers_tiny_gradients_to_fp32_accuracy():
    init, ref, ref_losses, ref_grads = _regression_run("fp32")
    _, got, losses, grads = _regression_run("fp16+scaler")
    assert ref_grads[0].abs().max() < 1e-7  # the problem really has tiny gradients
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= FP16_RTOL * r.abs().max()
    assert (got - ref).abs().max() <= FP16_RTOL * (ref - init).abs().max()
    assert losses[-1] < 0.1 * losses[0]
    assert losses == pytest.approx(ref_losses, rel=1e-2)


# -- overflow ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_injected_inf_skips_the_step_and_backs_off(fused):
    model = linear()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler = GradScaler(init_scale=2.0**10, backoff_factor=0.25)
    one_step(scaler, model, opt)  # a clean step first, so exp_avg, exp_avg_sq and step exist
    before = snapshot(model, opt)

    one_step(scaler, model, opt, inf=True)

    assert_unchanged(before, model, opt)
    assert scaler.get_scale() == 2.0**10 * 0.25 == device_scale(scaler)
    rec = scaler.record
    assert rec.last_step_skipped and rec.skipped_steps == 1 and rec.steps == 2
    assert [e.skipped for e in rec.history] == [False, True]
    assert rec.history[-1].scale == 2.0**10  # the scale the skipped step ran with

    one_step(scaler, model, opt)  # and training resumes
    assert not scaler.record.last_step_skipped
    assert not torch.equal(before[0][0], model.weight.detach())


def test_real_fp16_overflow_in_the_forward_pass_is_caught():
    # Activations of 1e3 * weights of 1e2 overflow fp16's 65504 inside the matmul: no injection.
    model = linear(n_in=8)
    with torch.no_grad():
        model.weight.fill_(100.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    before = snapshot(model, opt)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.full((2, 8), 1e3)).float().mean()
    assert not torch.isfinite(loss)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert_unchanged(before, model, opt)
    assert scaler.record.last_step_skipped and scaler.get_scale() == 2.0**15


def test_fused_skip_with_several_dtype_groups_skips_once():
    # One fused AdamW over fp32 and bf16 parameters runs one kernel per dtype. A fused optimizer skips only
    # when found_inf == 1.0 and subtracts found_inf from its step count, so an inf in both groups must not
    # add up to 2 (which applied the update with inf gradients and rewound `step` past the skip).
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([a, b], lr=0.1, fused=True)
    scaler = GradScaler()
    for inject in (False, True):
        if inject:
            before = [a.detach().clone(), b.detach().clone()], copy.deepcopy(opt.state_dict())
        scaler.scale(a.sum() + b.float().sum()).backward()
        if inject:
            a.grad[0], b.grad[0] = INF, INF
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert torch.equal(before[0][0], a.detach()) and torch.equal(before[0][1], b.detach())
    assert opt.state[a]["step"].item() == 1 and opt.state[b]["step"].item() == 1
    assert scaler.record.last_step_skipped


# -- hysteresis, growth, bounds -----------------------------------------------------------------------------


def _scales(scaler: GradScaler, pattern: str) -> list[float]:
    """Run one step per character ('x' overflow, '.' clean) and return the scale after each."""
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for c in pattern:
        one_step(scaler, model, opt, inf=(c == "x"))
        out.append(scaler.get_scale())
        assert out[-1] == device_scale(scaler)
    return out


def test_hysteresis_tolerates_overflows_and_backs_off_on_the_nth():
    s = GradScaler(init_scale=64.0, hysteresis=3, growth_interval=1000)
    # backs off on the 3rd overflow; the count is spent, so every further overflow backs off until growth
    assert _scales(s, "xxxxxx") == [64, 64, 32, 16, 8, 4]
    assert s.record.skipped_steps == 6  # tolerated overflows still skip the step


def test_hysteresis_count_is_restored_by_growth_not_by_clean_steps():
    s = GradScaler(init_scale=64.0, hysteresis=2, growth_interval=3)
    # x: 1 left; ..: clean but no growth yet, count not restored; x: backs off
    assert _scales(s, "x..x") == [64, 64, 64, 32]
    s = GradScaler(init_scale=64.0, hysteresis=2, growth_interval=2)
    # x: 1 left; ..: growth restores the count to 2; x: tolerated; x: backs off
    assert _scales(s, "x..xx") == [64, 64, 128, 128, 64]


def test_hysteresis_one_is_torchs_behaviour():
    pattern = "..x...x.xx....."
    ours = _scales(GradScaler(init_scale=2.0**8, growth_interval=3), pattern)
    theirs = []
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for c in pattern:
        one_step(torch_scaler, model, opt, inf=(c == "x"))
        theirs.append(torch_scaler.get_scale())
    assert ours == theirs


def test_scale_grows_after_growth_interval_clean_steps():
    s = GradScaler(init_scale=4.0, growth_factor=3.0, growth_interval=3)
    # an overflow restarts the clean-step count
    assert _scales(s, "..x...") == [4, 4, 2, 2, 2, 6]


def test_scale_holds_at_the_floor_where_torchs_reaches_zero():
    ours = GradScaler(max_consecutive_skips=None)  # min_scale defaults to 1.0
    ours_scales = _scales(ours, "x" * 200)
    assert ours_scales[-1] == 1.0 == min(ours_scales)

    torch_scaler = torch.amp.GradScaler("cpu")
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(200):  # 2^16 * 0.5^200: past fp32's smallest subnormal (2^-149)
        one_step(torch_scaler, model, opt, inf=True)
    assert torch_scaler.get_scale() == 0.0  # training would silently never step again


def test_scale_never_exceeds_the_ceiling():
    s = GradScaler(init_scale=2.0**16, max_scale=2.0**18, growth_interval=1)
    assert _scales(s, "." * 6) == [2.0**17, 2.0**18, 2.0**18, 2.0**18, 2.0**18, 2.0**18]


def test_unbounded_ceiling_stops_at_fp32s_largest_power_of_two():
    # With max_scale=inf the device kernel refuses a non-finite scale; the host mirror must agree.
    s = GradScaler(init_scale=2.0**126, max_scale=INF, growth_interval=1)
    assert _scales(s, "...") == [2.0**127] * 3


def test_host_mirror_matches_the_device_over_random_sequences():
    """get_scale() never syncs: it reads a host mirror. Over random skip/clean sequences with hysteresis,
    odd factors and bounds that are not powers of two, the mirror must equal the device scale exactly and
    follow the documented rules (checked against a plain-Python model of them)."""
    rng = random.Random(1234)
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(8):
        cfg = dict(
            hysteresis=rng.randint(1, 4),
            growth_interval=rng.randint(1, 5),
            growth_factor=rng.choice([2.0, 1.5, 3.0, 1.1]),
            backoff_factor=rng.choice([0.5, 0.3, 0.9, 0.125]),
            min_scale=rng.choice([1.0, 0.1, 3.7]),
            max_scale=rng.choice([2.0**12, 1e4 + 0.3, 5000.0]),
            max_consecutive_skips=None,
        )
        cfg["init_scale"] = rng.uniform(cfg["min_scale"], cfg["max_scale"])
        scaler = GradScaler(**cfg)
        ref = _ReferenceScale(**{k: v for k, v in cfg.items() if k != "max_consecutive_skips"})
        p_skip = rng.choice([0.1, 0.5, 0.9])
        for _ in range(150):
            skip = rng.random() < p_skip
            one_step(scaler, model, opt, inf=skip)
            ref.update(skip)
            assert scaler.get_scale() == device_scale(scaler) == ref.scale, cfg
            assert cfg["min_scale"] <= scaler.get_scale() <= cfg["max_scale"]
            assert scaler.record.scale == scaler.get_scale()


class _ReferenceScale:
    """The documented rules in plain Python, rounding to fp32 as the device tensor does."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale):
        self.f = lambda v: torch.tensor(v, dtype=torch.float32).item()
        self.scale, self.gf, self.bf, self.gi = self.f(init_scale), growth_factor, backoff_factor, growth_interval
        self.h = self.left = hysteresis
        self.lo, self.hi, self.streak = min_scale, max_scale, 0

    def update(self, skipped: bool) -> None:
        if skipped:
            self.streak, self.left = 0, max(self.left - 1, 0)
            if self.left > 0:
                return
            self.scale = self.f(self.scale * self.bf)
        else:
            self.streak += 1
            if self.streak == self.gi:
                self.streak, self.left, self.scale = 0, self.h, self.f(self.scale * self.gf)
        self.scale = self.f(min(max(self.scale, self.lo), self.hi))


# -- the consecutive-skip error --------------------------------------------------------------------------


def test_consecutive_skips_raise_naming_the_nonfinite_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler(max_consecutive_skips=3)
    scaler.register_param_names(model.named_parameters())

    def step(inf: bool) -> None:
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if inf:
            model[2].weight.grad[0, 0] = math.nan
        scaler.step(opt)
        scaler.update()

    step(True)
    step(True)
    opt.zero_grad()
    step(False)  # a clean step resets the count
    step(True)
    step(True)
    with pytest.raises(ConsecutiveSkipsError, match=r"3 optimizer steps in a row") as info:
        step(True)
    msg = str(info.value)
    assert "2.weight" in msg
    assert "0.weight" not in msg and "2.bias" not in msg  # only the non-finite ones are named
    assert scaler.nonfinite_grad_names(opt) == ["2.weight"]


def test_consecutive_skip_error_can_be_turned_off():
    s = GradScaler(max_consecutive_skips=None)
    _scales(s, "x" * 150)  # past the default limit of 100: no error
    assert s.record.consecutive_skips == 150


# -- state dict --------------------------------------------------------------------------------------------


def test_state_dict_round_trip_continues_identically():
    pattern = ".x..x.xx...." + "..x.x...x..."
    cut = 12

    def fresh():
        model = linear()
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    model, opt = fresh()
    scaler = GradScaler(init_scale=2.0**8, growth_interval=3, hysteresis=2)
    for c in pattern[:cut]:
        one_step(scaler, model, opt, inf=(c == "x"))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
    json.dumps(saved[2])  # safe to store without pickle
    tail = []
    for c in pattern[cut:]:
        one_step(scaler, model, opt, inf=(c == "x"))
        tail.append(scaler.get_scale())

    model2, opt2 = fresh()
    scaler2 = GradScaler()  # defaults: everything that matters comes from the state dict
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    scaler2.load_state_dict(saved[2])
    assert scaler2.record.steps == cut
    tail2 = []
    for c in pattern[cut:]:
        one_step(scaler2, model2, opt2, inf=(c == "x"))
        tail2.append(scaler2.get_scale())
    assert tail2 == tail
    assert scaler2.state_dict() == scaler.state_dict()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def _run(scaler, pattern: str) -> list[float]:
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for c in pattern:
        one_step(scaler, model, opt, inf=(c == "x"))
        out.append(scaler.get_scale())
    return out


def test_torch_state_dict_loads_into_ours_and_ours_into_torchs():
    kw = dict(init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", **kw)
    _run(theirs, "..x.....x.")  # ends two clean steps into a growth interval
    ours = GradScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale() and ours.get_growth_interval() == 3
    assert _run(ours, ".x.....") == _run(theirs, ".x.....")  # the growth tracker came across too

    ours = GradScaler(**kw)
    _run(ours, ".....x..")
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == ours.get_scale()
    assert _run(theirs, ".x....") == _run(ours, ".x....")


def test_loaded_scale_is_kept_within_the_bounds():
    dead = torch.amp.GradScaler("cpu").state_dict() | {"scale": 0.0}  # torch's scaler after many infs
    ours = GradScaler()
    ours.load_state_dict(dead)
    assert ours.get_scale() == 1.0 == device_scale(ours)
    # a torch scaler that grew past our default ceiling is taken in, as init_scale is (it was clamped to 2^24)
    grown = torch.amp.GradScaler("cpu").state_dict() | {"scale": 2.0**30}
    ours = GradScaler()
    ours.load_state_dict(grown)
    assert ours.get_scale() == 2.0**30 and ours.max_scale == 2.0**30
    bounded = GradScaler(max_scale=2.0**20)  # bounds given explicitly hold
    bounded.load_state_dict(grown)
    assert bounded.get_scale() == 2.0**20


def test_empty_state_dict_from_a_disabled_torch_scaler_is_refused():
    with pytest.raises(RuntimeError, match="empty"):
        GradScaler().load_state_dict({})


# -- fused AdamW ------------------------------------------------------------------------------------------


def test_fused_adamw_matches_foreach_and_reports_the_same_skips():
    results = {}
    for fused in (False, True):
        model = make_tiny_lm()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        scaler = GradScaler()
        for i, batch in enumerate(make_batches(8)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            if i == 3:
                model.head.weight.grad[0, 0] = INF
                before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if i == 3:
                assert scaler.record.last_step_skipped
                assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        results[fused] = model, scaler.record
    (m0, r0), (m1, r1) = results[False], results[True]
    assert [e.skipped for e in r0.history] == [e.skipped for e in r1.history] == [i == 3 for i in range(8)]
    for p, q in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)  # fp32 Adam arithmetic, two implementations


def test_fused_optimizer_after_unscale_and_clipping_is_not_unscaled_twice():
    results = []
    for fused in (False, True):
        model = linear()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        scaler = GradScaler()
        for _ in range(3):
            scaler.scale(model(torch.ones(2, 4)).square().sum()).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append(model.weight.detach())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_found_inf_reducer_makes_every_rank_skip_together(fused):
    # A distributed strategy installs an in-place all-reduce of the inf flag. Simulated here: another rank
    # overflowed (the flag becomes 1 although our gradients are finite), or a SUM over two overflowing
    # ranks (2.0, which a fused optimizer would not treat as a skip unless the scaler clamps it).
    for reducer in (lambda t: t.fill_(1.0), lambda t: t.add_(1.0).mul_(2.0)):
        model = linear()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        scaler = GradScaler()
        scaler.set_found_inf_reducer(reducer)
        one_step(scaler, model, opt)  # state exists; this step is skipped too (the reducer says so)
        before = snapshot(model, opt)
        one_step(scaler, model, opt)
        assert_unchanged(before, model, opt)
        assert scaler.record.skipped_steps == 2
        assert all(torch.isfinite(p).all() for p in model.parameters())


# -- host syncs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_at_most_one_host_read_per_step(monkeypatch, fused):
    """On CPU there is no device to wait for, so count the calls that would sync on a GPU: reading a tensor
    into Python. The optimizer's own reads (if any) are measured alone and subtracted."""
    reads = {"n": 0}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            reads["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    model = linear()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    scaler = GradScaler()
    x = torch.ones(2, 4)
    for _ in range(3):
        loss = model(x).square().mean()
        scaled = scaler.scale(loss)
        scaled.backward()
        reads["n"] = 0
        scaler.step(opt)
        scaler.update()
        with_scaler = reads["n"]
        reads["n"] = 0
        opt.step()  # what the optimizer reads by itself (the grads are unscaled by now or zero: harmless)
        alone = reads["n"]
        opt.zero_grad()
        assert with_scaler - alone <= 1, (with_scaler, alone)


# -- pass-through ----------------------------------------------------------------------------------------


def test_disabled_scaler_is_a_pass_through_with_the_same_interface():
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.resolve_precision("bf16", "cpu").make_scaler()
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0
    before = model.weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.ones(2, 4)).float().mean()
    assert scaler.scale(loss) is loss
    loss.backward()
    grad = model.weight.grad.clone()
    scaler.unscale_(opt)
    assert torch.equal(model.weight.grad, grad)  # unscale_ is a no-op
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model.weight.detach())  # step stepped
    assert scaler.record.steps == 1 and scaler.record.skipped_steps == 0
    assert scaler.get_scale() == 1.0
    json.dumps(scaler.state_dict())


# -- misuse ------------------------------------------------------------------------------------------------


def test_out_of_order_calls_name_the_call():
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match=r"step\(\) was called before scale\(\)"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) was called before scale\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"update\(\) was called without scaler.step"):
        scaler.update()

    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"update\(\) was called without scaler.step"):
        scaler.update()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) was called after step\(\)"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match=r"step\(\) was called before scale\(\)"):
        scaler.step(opt)  # a new step needs a new scale()


def test_fp16_master_weights_are_refused_with_the_fix():
    model = linear(dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    scaler.register_param_names(model.named_parameters())
    scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match=r"weight has fp16 gradients.*model.half"):
        scaler.step(opt)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale"),
        ({"init_scale": 2.0**30, "max_scale": 2.0**24}, "init_scale"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "init_scale"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"history_size": 0}, "history_size"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GradScaler(**kwargs)


def test_a_number_as_first_argument_is_taken_for_init_scale_and_refused():
    with pytest.raises(TypeError, match=r"init_scale=1024"):
        GradScaler(1024)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_warns_and_does_nothing_as_torchs():
    # `GradScaler("cuda", enabled=args.fp16)` is the everyday torch spelling; it must run on a laptop.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = GradScaler("cuda", enabled=False)
    with pytest.warns(UserWarning, match=r"CUDA is not available.*Omit device="):
        loud = GradScaler("cuda")
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for scaler in (quiet, loud):
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0
        before = model.weight.detach().clone()
        one_step(scaler, model, opt)  # a plain fp32 step: scale() returns the loss untouched
        assert not torch.equal(before, model.weight)
        assert scaler.state_dict() == {}


def test_init_scale_outside_the_default_bounds_is_accepted_as_in_torch():
    # torch's own test starts at 1e38 with growth 16 and checks the scale never becomes inf.
    big = GradScaler(init_scale=1e38, growth_factor=2.0**4, growth_interval=1)
    assert big.max_scale == pytest.approx(1e38) and big.min_scale == 1.0
    assert _scales(big, "...") == [big.get_scale()] * 3 and math.isfinite(big.get_scale())
    small = GradScaler(init_scale=2.0**-4)
    assert small.min_scale == 2.0**-4 and small.max_scale == 2.0**24
    assert _scales(small, "x.") == [2.0**-4, 2.0**-4]  # the floor is where it started


def test_disabled_state_dict_is_empty_and_loading_our_old_ones_still_works():
    disabled = GradScaler(enabled=False)
    assert disabled.state_dict() == {}
    disabled.load_state_dict({})  # ignored, as torch's disabled scaler does
    old_disabled = {  # what a disabled mixprec scaler saved before it returned {}
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
        "hysteresis": 1,
        "_hysteresis_left": 1,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "record": {
            "steps": 3,
            "skipped_steps": 0,
            "consecutive_skips": 0,
            "last_step_skipped": False,
            "scale": 1.0,
            "history": [],
        },
    }
    disabled.load_state_dict(old_disabled)
    enabled = GradScaler()
    enabled.load_state_dict(old_disabled)
    assert enabled.get_scale() == 65536.0 and enabled.record.steps == 3


class _SelfScalingSGD(torch.optim.SGD):
    """An optimizer in torch's older contract: it declares _step_supports_amp_scaling and takes grad_scaler=."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self._step_supports_amp_scaling = True
        self.seen = []

    def step(self, closure=None, *, grad_scaler=None):
        self.seen.append(grad_scaler)
        grad_scaler.unscale_(self)  # it checks its own gradients, so update() has a check to use
        return super().step(closure)


def test_optimizer_declaring_amp_scaling_support_is_handed_the_scaler():
    model = linear()
    opt = _SelfScalingSGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=8.0, growth_interval=1)
    with pytest.warns(FutureWarning, match="stop passing itself"):
        one_step(scaler, model, opt)
    assert opt.seen == [scaler] and scaler.get_scale() == 16.0
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_update_without_any_inf_check_names_the_fix():
    class Silent(_SelfScalingSGD):
        def step(self, closure=None, *, grad_scaler=None):
            pass

    model = linear()
    scaler = GradScaler()
    with pytest.warns(FutureWarning), pytest.raises(RuntimeError, match="unscale_"):
        one_step(scaler, model, Silent(model.parameters(), lr=0.1))


def test_scale_walks_namedtuples_and_generators():
    from collections import namedtuple

    Out = namedtuple("Out", "loss aux")
    scaler = GradScaler(init_scale=4.0)
    out = scaler.scale(Out(torch.tensor(1.0), [torch.tensor(2.0)]))
    assert isinstance(out, Out) and out.loss.item() == 4.0 and out.aux[0].item() == 8.0
    lazy = scaler.scale(t for t in (torch.tensor(1.0), torch.tensor(3.0)))
    assert [t.item() for t in lazy] == [4.0, 12.0]


# -- more than the simple loop ------------------------------------------------------------------------------


def test_multiple_optimizers_share_one_scale_as_in_torch():
    enc, dec = linear(0), linear(1, n_in=3, n_out=2)
    opt_enc = torch.optim.SGD(enc.parameters(), lr=0.1)
    opt_dec = torch.optim.SGD(dec.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0**8)
    enc_before, dec_before = enc.weight.detach().clone(), dec.weight.detach().clone()
    scaler.scale(dec(enc(torch.ones(2, 4))).square().sum()).backward()
    dec.weight.grad[0, 0] = INF
    scaler.step(opt_enc)
    scaler.step(opt_dec)
    scaler.update()
    # Each optimizer skips on its own gradients (torch's rule); the scale backs off once for the step.
    assert not torch.equal(enc_before, enc.weight.detach())
    assert torch.equal(dec_before, dec.weight.detach())
    assert scaler.get_scale() == 2.0**7 and scaler.record.last_step_skipped and scaler.record.steps == 1


def test_gradient_accumulation_scales_each_micro_batch_and_steps_once():
    x = torch.linspace(-1, 1, 32).reshape(8, 4)
    ref = linear()
    ref(x).square().mean().backward()

    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    with torch.autocast("cpu", dtype=torch.float16):
        for chunk in x.chunk(4):
            scaler.scale(model(chunk).float().square().mean() / 4).backward()
    scaler.unscale_(opt)
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=FP16_RTOL, atol=1e-4)
    scaler.step(opt)
    scaler.update()
    assert scaler.record.steps == 1 and not scaler.record.last_step_skipped


def test_unscale_then_clip_sees_true_gradient_norms():
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = linear()
    ref(torch.ones(2, 4)).square().sum().backward()
    scaler = GradScaler()
    scaler.scale(model(torch.ones(2, 4)).square().sum()).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    assert norm.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item(), rel=1e-6)
    scaler.step(opt)  # step after unscale_ does not unscale again
    scaler.update()
    assert scaler.record.steps == 1


def test_scale_accepts_nested_losses():
    scaler = GradScaler(init_scale=4.0)
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    out = scaler.scale({"a": a, "rest": [b, (a,)]})
    assert out["a"].item() == 4.0 and out["rest"][0].item() == 8.0 and out["rest"][1][0].item() == 4.0
    with pytest.raises(TypeError, match="scale"):
        scaler.scale("loss")


def test_set_scale_through_update_stays_within_bounds():
    s = GradScaler(max_scale=2.0**20)
    s.update(2.0**30)
    assert s.get_scale() == 2.0**20
    with pytest.raises(ValueError, match="new_scale"):
        s.update(0.0)


@pytest.mark.parametrize("new_scale", [0.5, 2.0**30, torch.tensor(64.0)])
def test_update_with_a_new_scale_sets_it_exactly_as_torchs(new_scale):
    # it was clamped silently into the default bounds [1, 2^24]
    theirs, ours = torch.amp.GradScaler("cpu", init_scale=8.0), GradScaler(init_scale=8.0)
    for scaler in (theirs, ours):
        _run(scaler, ".")
        scaler.update(new_scale)
    assert ours.get_scale() == theirs.get_scale() == float(new_scale) == device_scale(ours)
    assert ours.record.scale == float(new_scale)


def test_update_with_a_new_scale_records_the_step_it_ends():
    # the step's skip went unrecorded, so a scheduler reading last_step_skipped advanced after a skipped step
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=8.0)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = INF
    scaler.step(opt)
    scaler.update(64.0)
    record = scaler.record
    assert (record.steps, record.skipped_steps, record.last_step_skipped, record.scale) == (1, 1, True, 64.0)
    assert [(e.scale, e.skipped) for e in record.history] == [(8.0, True)]


def test_an_inf_check_of_an_optimizer_unscaled_and_not_stepped_backs_the_scale_off_as_in_torch():
    def run(scaler):
        a, b = linear(0), linear(1)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        scaler.scale(a(torch.ones(2, 4)).sum() + b(torch.ones(2, 4)).sum()).backward()
        b.weight.grad[0, 0] = INF
        scaler.unscale_(opt_b)
        scaler.step(opt_a)
        scaler.update()
        return scaler.get_scale()

    assert run(GradScaler(init_scale=8.0)) == run(torch.amp.GradScaler("cpu", init_scale=8.0)) == 4.0


def test_loss_scaler_is_the_same_class():
    assert mixprec.LossScaler is GradScaler
