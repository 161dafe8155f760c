"""CUDA versions of the key scaler and precision checks. Marked ``gpu``: conftest skips them without CUDA.

On a GPU a host sync is real, so the "at most one per step" promise is checked with torch's own sync
detector (``torch.cuda.set_sync_debug_mode``) rather than by counting Python-side reads as on CPU.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

import mixprec
from conftest import make_batches, make_tiny_lm
from mixprec import GradScaler, resolve_precision

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
INF = float("inf")
FP16_RTOL = 5e-3  # as in test_scaler.py: fp16 unit roundoff 4.9e-4, 10x margin


def _step(scaler, model, opt, *, inf=False):
    x = torch.linspace(-1, 1, 2 * model.in_features, device=CUDA).reshape(2, model.in_features)
    scaler.scale(model(x).square().mean()).backward()
    if inf:
        model.weight.grad[0, 0] = INF
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3).to(CUDA)


def test_seed_snippet_on_cuda_takes_the_device_from_the_loss():
    model = make_tiny_lm().to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = mixprec.GradScaler()
    losses = []
    for batch in make_batches(30):
        inputs, targets = batch["input_ids"].to(CUDA), batch["labels"].to(CUDA)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            outputs = model(inputs, labels=targets)
            loss = outputs.loss
        scaled = scaler.scale(loss)
        assert scaled.device.type == "cuda"
        scaled.backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert scaler.is_enabled() and scaler.get_scale() > 1.0
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_underflow_on_cuda_is_recovered_by_scaling():
    def run(mode):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(32, 8, generator=g).to(CUDA), torch.randn(4, 8, generator=g).to(CUDA)
        y = x @ w.T
        torch.manual_seed(1)
        lin = torch.nn.Linear(8, 4, bias=False).to(CUDA)
        opt = torch.optim.SGD(lin.parameters(), lr=1e7)
        scaler = GradScaler(enabled=(mode == "scaled"))
        with torch.autocast("cuda", dtype=torch.float16, enabled=(mode != "fp32")):
            out = lin(x)
        scaler.scale(0.5e-9 * (out.float() - y).square().sum()).backward()
        scaler.unscale_(opt)
        return lin.weight.grad.clone()

    ref, unscaled, scaled = run("fp32"), run("fp16"), run("scaled")
    assert torch.count_nonzero(unscaled) == 0
    assert (scaled - ref).abs().max() <= FP16_RTOL * ref.abs().max()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_injected_inf_on_cuda_skips_with_optimizer_state_intact(fused):
    model = _linear()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler = GradScaler(init_scale=2.0**10)
    _step(scaler, model, opt)
    params, state = [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())
    _step(scaler, model, opt, inf=True)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    now = opt.state_dict()["state"]
    for key, s in state["state"].items():
        for name, value in s.items():  # exp_avg, exp_avg_sq, step
            assert torch.equal(torch.as_tensor(value).cpu(), torch.as_tensor(now[key][name]).cpu()), name
    assert scaler.get_scale() == 2.0**9 and scaler.record.last_step_skipped


def test_fused_adamw_on_cuda_with_two_dtype_groups_skips_once():
    a = torch.nn.Parameter(torch.ones(4, device=CUDA))
    b = torch.nn.Parameter(torch.ones(4, device=CUDA, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([a, b], lr=0.1, fused=True)
    scaler = GradScaler()
    for inject in (False, True):
        if inject:
            before = a.detach().clone(), b.detach().clone()
        scaler.scale(a.sum() + b.float().sum()).backward()
        if inject:
            a.grad[0], b.grad[0] = INF, INF
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert torch.equal(before[0], a.detach()) and torch.equal(before[1], b.detach())
    assert opt.state[a]["step"].item() == 1 and opt.state[b]["step"].item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_of_every_dtype_unscale_on_cuda_as_the_fused_kernel_computes(dtype):
    # torch 2.11's CUDA kernel refuses bf16 (issue 28); whichever path runs, the result is the kernel's
    # arithmetic: the value checked, multiplied in fp32 by the fp32 inverse scale, rounded once to nearest
    from mixprec.scaling.unscale import check_and_unscale_

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) * 100 for n in (5, 300, 1)]
    base[2][0] = float("nan")
    inv_scale = torch.tensor(1000.0, dtype=torch.float64).reciprocal().float()
    for poisoned in (False, True):
        grads = [t.to(dtype).to(CUDA) for t in (base if poisoned else base[:2])]
        want = [(t.float() * inv_scale.to(CUDA)).to(dtype) for t in grads]
        flag = torch.zeros((), device=CUDA)
        check_and_unscale_(grads, flag, inv_scale.to(CUDA))
        assert flag.item() == float(poisoned)
        for got, ref in zip(grads, want):
            assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_host_mirror_equals_the_cuda_scale_over_random_sequences():
    rng = random.Random(7)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(4):
        scaler = GradScaler(
            init_scale=rng.choice([2.0**10, 1000.0]),
            hysteresis=rng.randint(1, 3),
            growth_interval=rng.randint(1, 4),
            growth_factor=rng.choice([2.0, 1.5]),
            backoff_factor=rng.choice([0.5, 0.3]),
            min_scale=rng.choice([1.0, 0.1]),
            max_scale=rng.choice([2.0**12, 5000.0]),
            max_consecutive_skips=None,
        )
        for _ in range(100):
            _step(scaler, model, opt, inf=rng.random() < 0.5)
            assert scaler.get_scale() == scaler.scale(torch.ones((), device=CUDA)).item()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_at_most_one_host_sync_per_step_on_cuda(fused):
    model = _linear()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    scaler = GradScaler()
    x = torch.ones(2, 4, device=CUDA)
    _step(scaler, model, opt)  # lazy init and optimizer state outside the measured steps
    for _ in range(3):
        scaler.scale(model(x).square().mean()).backward()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # only torch's sync report: its "Synchronization debug mode is a prototype feature" warning is not one
        syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        assert len(syncs) <= 1, [str(w.message) for w in syncs]
        opt.zero_grad()


def test_state_dict_interoperates_with_torchs_cuda_scaler():
    theirs = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for c in "..x.....x.":
        _step(theirs, model, opt, inf=(c == "x"))
    ours = GradScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale()
    theirs2 = torch.amp.GradScaler("cuda")
    theirs2.load_state_dict(ours.state_dict())
    assert theirs2.get_scale() == ours.get_scale()


def test_explicit_cuda_device_refuses_a_cpu_loss():
    scaler = GradScaler(device="cuda")
    with pytest.raises(RuntimeError, match=r"device='cuda'.*omit device="):
        scaler.scale(torch.ones(()))


def test_precision_on_cuda_runs_as_asked():
    lin = torch.nn.Linear(8, 4).to(CUDA)
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        p = resolve_precision(name, "cuda")
        with p.autocast():
            assert lin(torch.ones(2, 8, device=CUDA)).dtype is dtype
        assert p.make_scaler().is_enabled() == (name == "fp16")
    native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    auto = resolve_precision("auto", "cuda")
    assert auto.name == ("bf16" if native_bf16 else "fp16")
    if native_bf16:
        with resolve_precision("bf16", "cuda").autocast():
            assert lin(torch.ones(2, 8, device=CUDA)).dtype is torch.bfloat16
    else:
        with pytest.raises(mixprec.PrecisionNotSupportedError, match="fp16"):
            resolve_precision("bf16", "cuda")
