"""PyTorch's CPU grad-scaling contract, checked against mixprec's GradScaler (or torch's, to compare).

The contracts come from reading PyTorch's own tests (``test/test_torch.py`` ``test_grad_scaling_*``,
``test_grad_scaler_pass_itself``, ``test_grad_scale_will_not_overflow``, ``test_params_invalidated_*``,
``test_pickle_gradscaler`` and the CUDA-less ``GradScaler("cuda")`` case from ``test_cuda.py``); the code is
ours. Each test names the torch test whose contract it checks. The implementation under test is chosen by
one environment variable, so the same file measures both libraries:

    PYTHONPATH=src:. pytest -q tests/compat/test_torch_grad_scaling.py                       # mixprec
    MIXPREC_COMPAT_IMPL=torch PYTHONPATH=src:. pytest -q tests/compat/test_torch_grad_scaling.py  # torch

Tests marked ``torch_private`` read torch's private attributes (as torch's own tests do); under mixprec they
are expected failures (xfail), named in the report, because those attributes are not part of the contract.
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings
from functools import partial

import pytest
import torch

import mixprec

IMPL = os.environ.get("MIXPREC_COMPAT_IMPL", "mixprec")
if IMPL not in ("mixprec", "torch"):
    raise ValueError(f"MIXPREC_COMPAT_IMPL={IMPL!r}: choose mixprec or torch")
# The one line a user changes: `from torch.amp import GradScaler` -> `from mixprec import GradScaler`.
GradScaler = torch.amp.GradScaler if IMPL == "torch" else mixprec.GradScaler
DEVICE = "cpu"
Scaler = partial(GradScaler, DEVICE)


def torch_private(attribute: str):
    """Marks a check that reads a private attribute of torch's scaler (not part of the drop-in contract)."""
    return pytest.mark.xfail(IMPL != "torch", reason=f"reads torch's private GradScaler.{attribute}", strict=True)


# -- the shared scaling case: a scaled model and an unscaled control, compared after a few steps ------------


def make_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, seed=0):
    """Two identical 8->8->8 MLPs with their optimizers (lr 1.0 magnifies any error), four batches, MSE, and
    the iteration at which an inf is planted (2)."""
    torch.manual_seed(seed)
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaled = copy.deepcopy(control)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (
        control,
        scaled,
        optimizer_ctor(control.parameters(), **kwargs),
        optimizer_ctor(scaled.parameters(), **kwargs),
        data,
        torch.nn.MSELoss(),
        2,
    )


def run_scaling_case(run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Runs ``run`` for the control (no scaling API) and the scaled model, enabled and disabled, and checks
    the scale's trajectory (x2 per clean step, x0.5 per skipped one from 128), the gradients, the optimizer
    state and the parameters. Scaling must be switchable off without changing the loop."""
    for enabled in (True, False):
        control, scaled, opt_c, opt_s, data, loss_fn, skip_iter = make_case(optimizer_ctor, optimizer_kwargs)
        scaler = Scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, control, opt_c, scaler, loss_fn, skip_iter, False)
        returned = run(data, scaled, opt_s, scaler, loss_fn, skip_iter, True)
        scaler = returned or scaler
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(control.parameters(), scaled.parameters()):
            torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=1e-5)
            for key, value in opt_c.state[c].items():
                torch.testing.assert_close(opt_s.state[s][key], value, atol=atol, rtol=1e-5, msg=key)
            torch.testing.assert_close(s, c, atol=atol, rtol=1e-5)


# -- scale() ---------------------------------------------------------------------------------------------


def test_grad_scaling_scale_nested_outputs():
    """test_grad_scaling_scale: scale() multiplies every tensor in nested tuples/lists, keeping structure."""
    scaler = Scaler(init_scale=2.0)
    t = torch.full((1,), 4.0)
    out = scaler.scale((t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())]))
    flat = [out[0], out[1][0], out[1][1], out[2][0], out[2][1][0], out[2][1][1]]
    assert all(x.item() == 8.0 for x in flat)
    assert isinstance(out[1], tuple) and isinstance(out[2], list) and all(x.device == t.device for x in flat)


def test_grad_scaling_scale_private_scale_tensor():
    """test_grad_scaling_scale's last line: the lazily created ``scaler._scale`` lives on the loss's device.
    Private in torch, but mixprec's scaler keeps the same tensor under the same name, so it is checked for both."""
    scaler = Scaler(init_scale=2.0)
    t = torch.full((1,), 4.0)
    scaler.scale(t)
    assert scaler._scale.device == t.device


# -- unscale_() --------------------------------------------------------------------------------------------


def _grads_with(value_at, layout):
    g = torch.full((20, 20), 4.0)
    if value_at is not None:
        g[2, 2] = value_at
    views = {
        "contiguous": lambda x: x.clone(),
        "transposed": lambda x: x.clone().t(),  # non-contiguous but dense
        "sliced": lambda x: x.clone()[:, :5],  # not dense: another kernel path
    }
    return views[layout](g)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_grad_scaling_unscale_finds_inf_and_nan_in_any_layout(layout):
    """test_grad_scaling_unscale: grads are multiplied by 1/scale and an inf or NaN anywhere is found, whatever
    the memory layout (dense grads take the multi-tensor kernel, others a fallback)."""
    for bad, expect_skip in ((None, False), (float("inf"), True), (float("nan"), True)):
        grads = [_grads_with(None, "contiguous"), _grads_with(bad, layout)]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=1.0)
        scaler = Scaler(init_scale=4.0)
        scaler.scale(torch.ones(()))  # the scale is created with the first loss
        scaler.unscale_(opt)
        if not expect_skip:
            assert all(torch.equal(p.grad, torch.ones_like(p.grad)) for p in params)
        scaler.step(opt)
        assert torch.equal(params[0], torch.zeros_like(params[0])) == expect_skip


def test_grad_scaling_unscale_mixed_dtypes_and_devices_all_checked():
    """test_grad_scaling_unscale (the "perfect storm"): grads of several dtypes are grouped and every group is
    checked; an inf injected into any one of them makes the step skip."""
    shapes_dtypes = [((3, 3), torch.float32), ((4,), torch.float64), ((2, 5), torch.float32), ((7,), torch.float64)]
    for inject in range(-1, len(shapes_dtypes)):
        params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in shapes_dtypes]
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 4.0)
            if i == inject:
                p.grad.view(-1)[0] = float("inf")
        opt = torch.optim.SGD(params, lr=1.0)
        scaler = Scaler(init_scale=4.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        stepped = all(not torch.equal(p, torch.zeros_like(p)) for p in params)
        assert stepped == (inject == -1)
        if inject == -1:
            assert all(torch.equal(p, torch.full_like(p, -1.0)) for p in params)  # 0 - lr * 4/4


def test_grad_scaling_unscale_sparse():
    """test_grad_scaling_unscale_sparse (its public half): sparse fp32 gradients are unscaled and checked,
    including an inf among their values."""
    for bad in (None, float("inf")):
        i = torch.tensor([[0, 1, 1], [2, 0, 2]])
        v = torch.tensor([16.0, 32.0, 64.0])
        if bad is not None:
            v[1] = bad
        p = torch.nn.Parameter(torch.zeros(2, 3))
        p.grad = torch.sparse_coo_tensor(i, v.clone(), (2, 3))  # the values are unscaled in place
        opt = torch.optim.SGD([p], lr=1.0)
        scaler = Scaler(init_scale=4.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        if bad is None:
            torch.testing.assert_close(p.grad.to_dense(), torch.sparse_coo_tensor(i, v / 4, (2, 3)).to_dense())
        scaler.step(opt)
        assert torch.equal(p.detach(), torch.zeros(2, 3)) == (bad is not None)


@torch_private("_unscale_grads_")
def test_grad_scaling_unscale_private_fp16_sparse_coalescing():
    """test_grad_scaling_unscale_sparse's fp16 half: torch's private ``_unscale_grads_(..., allow_fp16=True)``
    coalesces an uncoalesced fp16 sparse grad whose duplicate values overflow only when summed."""
    scaler = Scaler()
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0], dtype=torch.float16)
    p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    p.grad = torch.sparse_coo_tensor(torch.cat([i, i], 1), torch.cat([v, v]), (2, 3))
    opt = torch.optim.SGD([p], lr=1.0)
    found = torch.zeros(1)
    per_device = scaler._unscale_grads_(opt, torch.full((1,), 1.0), found, True)
    assert per_device[found.device].item() == 1.0


# -- update() and the scale's arithmetic --------------------------------------------------------------------


def test_grad_scaling_update_scale_follows_the_growth_and_backoff_rule():
    """test_grad_scaling_update_scale: growth after ``growth_interval`` clean steps (the count restarts), a
    backoff on every inf, the count reset by an inf."""
    scaler = Scaler(init_scale=2.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for bad in (False, False, False, True, False, False):
        scaler.scale((p * 0 + 1).sum()).backward()
        if bad:
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales == [2.0, 4.0, 4.0, 1.0, 1.0, 2.0]


def test_grad_scale_will_not_overflow():
    """test_grad_scale_will_not_overflow: an init_scale of 1e38 with growth 16 is accepted and the scale
    never becomes inf or NaN."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    scaler = Scaler(growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scale = torch.tensor(scaler.get_scale())
    assert torch.isfinite(scale)


# -- whole training loops against a control ---------------------------------------------------------------


def _autocast_run(try_pickle):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=DEVICE, dtype=torch.half, enabled=try_scaling_api):
                loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.float().backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()
        return scaler

    return run


OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {}),
    "SGD-foreach": (torch.optim.SGD, {"foreach": True}),
    "SGD-fused": (torch.optim.SGD, {"fused": True}),
    "Adam": (torch.optim.Adam, {}),
    "Adam-foreach": (torch.optim.Adam, {"foreach": True}),
    "Adam-fused": (torch.optim.Adam, {"fused": True}),
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW-foreach": (torch.optim.AdamW, {"foreach": True}),
    "AdamW-fused": (torch.optim.AdamW, {"fused": True}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaling_autocast(name):
    """test_grad_scaling_autocast (and _foreach, _fused): an fp16-autocast loop with the scaler matches an fp32
    control that skips the same step, within 1e-3 (torch's tolerance for fp16 vs fp32), also when the scaler
    is pickled and unpickled after every step. Adam normalises each update, so fp16 rounding of tiny
    gradients moves its parameters by up to lr: for Adam/AdamW the control is the same autocast forward with
    hand-written scaling instead (torch's test expects its own fp32 comparison to fail for Adam)."""
    ctor, kwargs = OPTIMIZERS[name]
    if ctor is torch.optim.SGD:
        for try_pickle in (False, True):
            run_scaling_case(_autocast_run(try_pickle), 3, 1, 1e-3, ctor, kwargs)
        return
    for try_pickle in (False, True):
        control, scaled, opt_c, opt_s, data, loss_fn, skip_iter = make_case(ctor, kwargs)
        scaler = Scaler(init_scale=128.0, growth_factor=2.0, growth_interval=1)
        scale = 128.0
        for i, (x, y) in enumerate(data):  # the control: what the scaler promises, by hand
            opt_c.zero_grad()
            with torch.autocast(device_type=DEVICE, dtype=torch.half):
                loss = loss_fn(control(x), y)
            (loss * scale).backward()
            if i == skip_iter:
                control[1].weight.grad.fill_(float("inf"))
            grads = [p.grad for p in control.parameters()]
            if all(torch.isfinite(g).all() for g in grads):
                for g in grads:
                    g.mul_(1.0 / scale)
                opt_c.step()
                scale *= 2.0
            else:
                scale *= 0.5
        returned = _autocast_run(try_pickle)(data, scaled, opt_s, scaler, loss_fn, skip_iter, True)
        assert returned.get_scale() == scale == 128.0 * 2.0**3 * 0.5
        for c, s in zip(control.parameters(), scaled.parameters()):
            torch.testing.assert_close(s, c, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["SGD", "SGD-foreach", "Adam", "Adam-foreach", "AdamW", "AdamW-foreach"])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(name):
    """test_params_invalidated_with_grads_invalidated_between_unscale_and_step: the inf check is made by
    unscale_(); gradients broken after it are not re-checked, so step() applies them (no hidden second
    check, no host sync in step beyond the one recorded at unscale_)."""
    ctor, kwargs = OPTIMIZERS[name]
    _, model, _, opt, data, loss_fn, _ = make_case(ctor, kwargs)
    scaler = Scaler(init_scale=128.0)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast(device_type=DEVICE, dtype=torch.half):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.copy_(torch.full_like(p.grad, float("inf") if j % 2 else float("nan")))
        scaler.step(opt)
        scaler.update()
    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


def test_grad_scaling_clipping():
    """test_grad_scaling_clipping: clipping the still-scaled gradients at max_norm * scale equals clipping the
    true gradients at max_norm."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("foreach", [False, True])
def test_grad_scaling_clipping_separate_unscale(foreach):
    """test_grad_scaling_clipping_separate_unscale: unscale_() then clip at max_norm; step() does not unscale
    twice, and an inf is still found (clip_grad_norm_ with error_if_nonfinite=False)."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, error_if_nonfinite=False, foreach=foreach)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, foreach=foreach)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_penalty():
    """test_grad_scaling_penalty: a gradient penalty built from autograd.grad of the scaled loss, unscaled by
    hand with 1/get_scale(), matches the unscaled control."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if try_scaling_api:
                grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv = 1.0 / scaler.get_scale()
                grads = [g * inv for g in grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    run_scaling_case(run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation():
    """test_grad_scaling_accumulation: two scaled backwards accumulate before one step/update."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / 2
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % 2 == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(run, unskipped=2, skipped=0)


def test_grad_scaling_multiple():
    """test_grad_scaling_multiple: two models, two losses, two optimizers, one scaler; an inf in one
    optimizer's grads skips only that optimizer, and the scale backs off once."""
    for enabled in (True, False):
        c0, s0, oc0, os0, data, loss_fn, skip_iter = make_case(seed=0)
        c1, s1, oc1, os1, _, _, _ = make_case(seed=1)
        scaler = Scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(m0, m1, o0, o1, api, data=data, loss_fn=loss_fn, scaler=scaler, skip_iter=skip_iter):
            for i, (x, y) in enumerate(data):
                o0.zero_grad()
                o1.zero_grad()
                out0 = m0(x)
                out1 = m1(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                if api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        m1[1].weight.grad.data.fill_(float("inf"))
                    scaler.unscale_(o0)  # one optimizer unscaled separately, the other by step()
                    scaler.step(o0)
                    scaler.step(o1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    o0.step()
                    if not scaler.is_enabled() or i != skip_iter:
                        o1.step()

        run(c0, c1, oc0, oc1, False)
        run(s0, s1, os0, os1, True)
        assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
        for c, s in zip(list(c0.parameters()) + list(c1.parameters()), list(s0.parameters()) + list(s1.parameters())):
            torch.testing.assert_close(s, c, atol=1e-7, rtol=1e-5)


# -- optimizers that handle scaling themselves ------------------------------------------------------------


def test_grad_scaler_pass_itself():
    """test_grad_scaler_pass_itself: an optimizer declaring ``_step_supports_amp_scaling`` gets
    ``grad_scaler=<the scaler>`` (with torch's FutureWarning) when its step() takes that keyword, and the
    ``grad_scale``/``found_inf`` tensors as attributes otherwise."""
    seen = {}

    class Declares(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class TakesScaler(Declares):
        def step(self, closure=None, *, grad_scaler=None):
            seen["scaler"] = grad_scaler
            seen["attrs"] = hasattr(self, "grad_scale") or hasattr(self, "found_inf")

    class TakesTensors(Declares):
        def step(self, closure=None):
            seen["tensors"] = isinstance(self.grad_scale, torch.Tensor) and isinstance(self.found_inf, torch.Tensor)

    m = torch.nn.Linear(4, 1)
    o1, o2 = TakesScaler(m.parameters()), TakesTensors(m.parameters())
    scaler = Scaler(init_scale=2.0)
    with torch.autocast(device_type=DEVICE, dtype=torch.half):
        loss = m(torch.randn(4, 4)).mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen == {"scaler": scaler, "attrs": False, "tensors": True}
    assert isinstance(seen["scaler"], GradScaler)


@pytest.mark.parametrize("ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("separate_unscale", [False, True])
def test_grad_scaling_autocast_fused_optimizers(ctor, separate_unscale):
    """test_cuda.py's test_grad_scaling_autocast_fused_optimizers, on CPU: a fused optimizer (which unscales
    and skips inside its kernel) ends where the for-loop one does, with or without a separate unscale_()."""
    results = []
    for fused in (False, True):
        _, model, _, opt, data, loss_fn, skip_iter = make_case(ctor, {"fused": fused, "lr": 0.01})
        scaler = Scaler(init_scale=128.0, growth_factor=2.0, growth_interval=1)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast(device_type=DEVICE, dtype=torch.half):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            if i == skip_iter:
                model[1].weight.grad.fill_(float("inf"))
            if separate_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        results.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0] == 128.0 * 2.0**3 * 0.5
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


# -- state_dict and pickling ------------------------------------------------------------------------------


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(lazy_init_scale):
    """test_grad_scaling_state_dict: load_state_dict carries the scale, factors and interval across, whether
    or not the receiving scaler already created its scale tensor."""
    s0 = Scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = Scaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (
        3.0,
        4.0,
        0.5,
        2,
    )
    if lazy_init_scale:  # the loaded scale reaches the device tensor the next scale() uses
        assert s1.scale(torch.full((1,), 1.0)).item() == 3.0


@torch_private("_init_growth_tracker")
def test_grad_scaling_state_dict_private_growth_tracker():
    """test_grad_scaling_state_dict's last line: the loaded growth tracker lands in ``_init_growth_tracker``."""
    s0, s1 = Scaler(init_scale=3.0), Scaler(init_scale=6.0)
    s1._init_growth_tracker = 7
    s1.load_state_dict(s0.state_dict())
    assert s1._init_growth_tracker == 0


def test_disabled_scaler_state_dict_is_empty():
    """torch's state_dict() contract: a disabled scaler returns {} and ignores what it is given to load."""
    scaler = Scaler(enabled=False)
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    with pytest.raises(RuntimeError):
        Scaler().load_state_dict({})  # an enabled one refuses an empty state


def test_pickle_gradscaler():
    """test_pickle_gradscaler (its public half): a scaler pickles before and after its scale exists, and the
    copy keeps its settings."""
    for lazy in (False, True):
        a = Scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        if lazy:
            a.scale(torch.tensor([4.0]))
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (
            3.0,
            4.0,
            0.5,
            2,
        )
        if lazy:
            assert b.scale(torch.tensor([4.0])).item() == 12.0


@torch_private("_per_optimizer_states")
def test_pickle_gradscaler_private_state():
    """test_pickle_gradscaler's private half: ``_init_growth_tracker`` and the ``_per_optimizer_states``
    defaultdict survive pickling."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    b = pickle.loads(pickle.dumps(Scaler(init_scale=3.0)))
    assert b._init_growth_tracker == 0
    assert b._per_optimizer_states["fdsa"] == _refresh_per_optimizer_state()


# -- construction on a machine without CUDA (test_cuda.py) -----------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-less behaviour needs a machine without CUDA")
def test_cuda_scaler_without_cuda_disables_itself():
    """GradScaler("cuda") without CUDA: with enabled=False it is silent, enabled it warns; both do nothing
    (the everyday ``GradScaler("cuda", enabled=args.fp16)`` runs on a laptop)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = GradScaler("cuda", enabled=False)
    with pytest.warns(UserWarning):
        loud = GradScaler("cuda")
    for scaler in (quiet, loud):
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0
        loss = torch.tensor(3.0)
        assert scaler.scale(loss) is loss
