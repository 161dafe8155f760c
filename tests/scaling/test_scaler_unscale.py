"""scaling/unscale.py: gradients of every floating dtype are unscaled and checked, with torch's fused kernel or,
where it refuses the dtype (torch 2.11's CUDA build and bf16, issue 28), the staged path, bit-exact with it.

On a CPU the fused kernel takes every dtype, so it is the reference the staged path is compared with, and the
CUDA refusal is planted by making the kernel raise as it does there.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec import GradScaler
from mixprec.scaling import unscale
from mixprec.scaling.unscale import check_and_unscale_, staged_check_and_unscale_

INF, NAN = float("inf"), float("nan")


def _grads(dtype: torch.dtype, *, poison: float | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # magnitudes over the whole range, so the rounding back to a half type is exercised; one non-contiguous
    shapes, e = [(7,), (3, 5), (1,), (40,)], 12 if dtype is torch.float16 else 20  # finite in the dtype
    grads = [(torch.randn(s, generator=g) * torch.exp2(torch.randint(-e, e, s, generator=g))).to(dtype) for s in shapes]
    grads[1] = grads[1].t()
    if poison is not None:
        grads[2][0] = poison
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("poison", [None, INF, -INF, NAN])
@pytest.mark.parametrize("scale", [65536.0, 1000.0, 0.3])  # a power of two, an inexact one, and one below 1
def test_staged_path_is_bit_exact_with_torchs_fused_kernel(dtype, poison, scale):
    inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    fused, staged = _grads(dtype, poison=poison), _grads(dtype, poison=poison)
    fused_inf, staged_inf = torch.zeros(()), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(fused, fused_inf, inv_scale)
    staged_check_and_unscale_(staged, staged_inf, inv_scale, stage_elements=16)  # several batches
    assert staged_inf.item() == fused_inf.item() == (poison is not None)
    for a, b in zip(fused, staged):
        assert a.dtype == b.dtype and a.stride() == b.stride()
        # every bit of every number (a NaN stays NaN; its payload bits may differ, and a NaN skips the step)
        assert torch.equal(a.isnan(), b.isnan()) and _same_bits(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _bits(t: torch.Tensor) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(_bits(a)), b.contiguous().view(_bits(b)))


def test_a_finite_value_that_the_multiply_overflows_is_not_flagged_as_in_the_fused_kernel():
    # the check reads the value before the multiply: 3e38 * 10 is inf after unscaling, but it was finite
    fused, staged = [torch.tensor([3e38])], [torch.tensor([3e38])]
    flags = torch.zeros(()), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(fused, flags[0], torch.tensor(10.0))
    staged_check_and_unscale_(staged, flags[1], torch.tensor(10.0))
    assert flags[0].item() == flags[1].item() == 0.0 and torch.equal(fused[0], staged[0])


@pytest.fixture
def cuda_like_kernel(monkeypatch):
    """torch's kernel as torch 2.11's CUDA build runs it: NotImplementedError for bf16 gradients."""
    real = torch._amp_foreach_non_finite_check_and_unscale_
    calls = {"refused": 0}

    def kernel(grads, found_inf, inv_scale):
        if grads and grads[0].dtype is torch.bfloat16:
            calls["refused"] += 1
            raise NotImplementedError(
                "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"
            )
        return real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", kernel)
    monkeypatch.setattr(unscale, "_REFUSED", set())
    return calls


def test_a_refused_dtype_is_learned_once_and_staged(cuda_like_kernel):
    for _ in range(3):
        grads, flag = _grads(torch.bfloat16, poison=NAN), torch.zeros(())
        check_and_unscale_(grads, flag, torch.tensor(0.5))
        assert flag.item() == 1.0
    assert cuda_like_kernel["refused"] == 1  # the raise is paid once per (device type, dtype)


def _mixed_dtype_run(fused: bool) -> tuple[list[torch.Tensor], dict, list[bool]]:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8))
    b = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))  # an adapter kept in bf16 beside fp32 weights
    opt = torch.optim.AdamW([a, b], lr=0.1, fused=fused)
    scaler = GradScaler(init_scale=1000.0)  # not a power of two: unscaling rounds
    for step in range(4):
        scaler.scale((a * a).sum() + (b.float() * 3).sum()).backward()
        if step == 2:
            b.grad[0] = INF  # the bf16 group alone overflows: the whole step must be skipped
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [a.detach(), b.detach()], copy.deepcopy(opt.state_dict()), scaler.record.history


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_scaler_with_bf16_gradients_where_the_kernel_refuses_them_matches_the_fused_path(fused, monkeypatch):
    want_params, want_state, want_history = _mixed_dtype_run(fused)
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def kernel(grads, found_inf, inv_scale):
        if grads and grads[0].dtype is torch.bfloat16:
            raise NotImplementedError("not implemented for 'BFloat16'")
        return real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", kernel)
    monkeypatch.setattr(unscale, "_REFUSED", set())
    params, state, history = _mixed_dtype_run(fused)
    assert history == want_history and [e.skipped for e in history] == [False, False, True, False]
    assert all(_same_bits(x, y) for x, y in zip(params, want_params))  # bit-exact
    for key, s in want_state["state"].items():
        for name, value in s.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state["state"][key][name])), name


def test_fsdp2s_dtensor_gradients_are_staged_through_their_local_shards():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grad = distribute_tensor(
            torch.tensor([2.0, NAN, 6.0]).to(torch.bfloat16), init_device_mesh("cpu", (1,)), [Shard(0)]
        )
        flag = torch.zeros(())
        staged_check_and_unscale_([grad], flag, torch.tensor(0.5))
        full = grad.full_tensor()
        assert flag.item() == 1.0 and full[0].item() == 1.0 and full[2].item() == 3.0 and full[1].isnan()
    finally:
        dist.destroy_process_group()
