"""The random bits of stochastic rounding: a counter hashed with a per-step key, a few elementwise ops.

Stochastic rounding to bf16 adds 16 uniform random bits below the kept mantissa (bf16_adamw.py). Drawing them
from torch's generator (mt19937 on a CPU) costs ~3 ns a value, which made the rounding half of a bf16-pure
optimizer step on the 25M-parameter GPT. Here they come from Chris Wellons' ``lowbias32`` integer hash of a
counter: about 0.3 ms per 256K values against 0.7-0.9 ms (benchmarks/README.md), uniform to the tests' chi^2
and bias checks. The key is drawn once per optimizer step from torch's generator of the device, and the
counter advances over every value of the step, so no two values of a step share an input, and a run resumed
with its checkpointed RNG state rounds exactly as the uninterrupted one. The key stays on the device (a 0-d
tensor added to the counter there): reading it on the host was one host sync per optimizer step on a GPU.
"""

from __future__ import annotations

import torch

_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32 (multiplication wraps)


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


class RoundingNoise:
    """Uniform integers in [0, 2^16), ``n`` at a time, for one device; buffers kept between calls."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.counter = 0  # values drawn since the key: the host part of the hash's input
        self._key: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._tmp: torch.Tensor | None = None

    def reseed(self) -> None:
        """A fresh key from torch's generator of the device (once per optimizer step). No host sync."""
        self._key = torch.randint(0, 1 << 31, (), device=self.device, dtype=torch.int32)
        self.counter = 0

    def bits(self, n: int) -> torch.Tensor:
        """``n`` values (int32) in [0, 65536); the returned tensor is overwritten by the next call."""
        if self._index is None or self._index.numel() < n:
            self._index = torch.arange(n, dtype=torch.int32, device=self.device)
            self._out = torch.empty(n, dtype=torch.int32, device=self.device)
            self._tmp = torch.empty(n, dtype=torch.int32, device=self.device)
        assert self._out is not None and self._tmp is not None
        if self._key is None:
            raise RuntimeError("RoundingNoise.bits() before reseed(): draw the step's key first")
        x, tmp = self._out[:n], self._tmp[:n]
        # key + counter + index, wrapping in int32 as the hash's 32-bit arithmetic does
        torch.add(self._index[:n], self._key + _as_int32(self.counter), out=x)  # one pass; the 0-d add is tiny
        self.counter = (self.counter + n) & 0xFFFFFFFF
        for shift, mask, multiplier in ((16, 0xFFFF, _M1), (15, 0x1FFFF, _M2), (16, 0xFFFF, None)):
            # x ^= x >> shift, as a logical shift (torch shifts int32 arithmetically, so mask the sign copies)
            x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_(mask))
            if multiplier is not None:
                x.mul_(multiplier)
        return x.bitwise_and_(0xFFFF)
