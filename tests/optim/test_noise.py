"""The rounding noise of Bf16AdamW: uniform 16-bit values, reproducible from torch's generator."""

from __future__ import annotations

import torch

from mixprec.optim.noise import RoundingNoise


def _draw(seed: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    noise = RoundingNoise("cpu")
    noise.reseed()
    return [noise.bits(n).clone() for n in sizes]


def test_the_values_are_uniform_16_bit_integers() -> None:
    (x,) = _draw(0, (1 << 18,))
    assert x.dtype == torch.int32 and int(x.min()) >= 0 and int(x.max()) < 1 << 16
    assert abs(x.double().mean().item() - 32767.5) < 5 * 18918 / 512  # five standard errors of the mean
    counts = torch.bincount(x >> 12, minlength=16).double()
    chi2 = (((counts - counts.mean()) ** 2) / counts.mean()).sum().item()
    assert chi2 < 40  # 15 degrees of freedom: p < 0.001 above 37.7
    low = torch.bincount(x & 15, minlength=16).double()  # the low bits too (they decide small carries)
    assert (((low - low.mean()) ** 2) / low.mean()).sum().item() < 40


def test_a_step_never_repeats_its_inputs_and_torchs_seed_reproduces_it() -> None:
    a, b = _draw(1, (1000, 1000))
    assert not torch.equal(a, b)  # the counter moved on between the two parameters of one step
    again = _draw(1, (1000, 1000))
    assert torch.equal(a, again[0]) and torch.equal(b, again[1])  # same generator state, same rounding
    assert not torch.equal(a, _draw(2, (1000,))[0])
