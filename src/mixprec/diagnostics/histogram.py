"""Log2-magnitude histograms: one bin per binary exponent, accumulated on the tensor's device.

A value x lands in bin e = floor(log2|x|), read exactly from ``torch.frexp`` (no rounding of a float log2
near powers of two). Exact zeros and non-finite values are counted apart: a zero gradient is not an
underflow, and an inf is not a magnitude. Because the format thresholds are powers of two, the count of
values that fp16 would flush to zero *after multiplying by a loss scale 2^k* is an exact sum of bins, for
any k, read off the same histogram.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.precision.formats import FORMATS, FloatFormat

# fp32 spans 2^-149 (smallest subnormal) to 2^127; values are binned from their fp32 bit pattern, and fp64
# values beyond fp32's range are kept at its extremes (they overflow or underflow every 16-bit format anyway,
# so no fraction the report shows changes). The margin on both sides is unused headroom for wider formats.
E_MIN = -160
E_MAX = 140
N_BINS = E_MAX - E_MIN + 1
_OVERFLOW_FORMATS: tuple[FloatFormat, ...] = tuple(FORMATS.values())


_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000  # |x| bit patterns above this are NaN
_ZERO_BIN, _INF_BIN, _NAN_BIN = N_BINS, N_BINS + 1, N_BINS + 2
_MAX_BITS = {fmt.name: int(torch.tensor(fmt.max, dtype=torch.float32).view(torch.int32)) for fmt in _OVERFLOW_FORMATS}


def _as_fp32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x
    if x.dtype != torch.float64:
        return x.float()  # fp16 / bf16: exact
    # fp64 beyond fp32's range: keep such values in the end bins rather than turning them into inf or 0
    tiny, big = 2.0**-149, float(torch.finfo(torch.float32).max)
    ax = x.abs()
    x = torch.where((ax < tiny) & (ax > 0), torch.copysign(torch.full_like(x, tiny), x), x)
    return torch.where(torch.isfinite(x), x.clamp(-big, big), x).float()


class DeviceHistogram:
    """Accumulates a log2-magnitude histogram of the tensors passed to :meth:`add` without a host sync.

    Everything stays on ``device`` until :func:`to_host` copies a batch of histograms back in one transfer.
    ``track_overflow`` adds the comparisons against the fp16 and bf16 maxima (not powers of two, so not
    readable off the bins); gradients skip them, their overflow is a matter of the loss scale.
    Memory: a few int32 temporaries the size of the tensor added, freed when ``add`` returns.
    """

    def __init__(self, device: torch.device, track_overflow: bool = True, bin_limit: int | None = None) -> None:
        self.device = device
        self.track_overflow = track_overflow
        self.bin_limit = bin_limit
        """None: bin every element (the diagnosis). N: bin an evenly strided subset of at most ~N elements of
        each tensor (the precision watch, on the training step): every count and fraction is then an estimate
        from the subset (``total`` counts the values binned), while the largest magnitude is exact over the
        whole tensor (when it holds no inf/NaN), and an inf/NaN anywhere in it is counted (at least once).
        Binning costs ~25 ns per element on a CPU; the exact maximum, one vectorised pass, far less."""
        # three spare bins at the end: exact zeros, inf, NaN; one bincount does all the counting
        self.counts = torch.zeros(N_BINS + 3, dtype=torch.int64, device=device)
        self.overflow = torch.zeros(len(_OVERFLOW_FORMATS), dtype=torch.int64, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float64, device=device)
        self.total = 0  # element count is known on the host: no sync needed

    def add(self, t: torch.Tensor, *also: DeviceHistogram) -> None:
        """Add every element of ``t`` (detached; any floating dtype) to this histogram and to each of ``also``
        (same device and ``track_overflow``): the tensor is read once however many totals it feeds.
        Does not force a host sync."""
        if t.numel() == 0:
            return
        x = t.detach().reshape(-1)
        if x.device != self.device:
            x = x.to(self.device)
        if self.bin_limit is not None and x.numel() > 2 * self.bin_limit:
            self._add_subset(x, also)
            return
        # The binary exponent is read from the fp32 bit pattern: exact, and a handful of cheap int32 passes
        # (torch.frexp is ~10x slower on CPU; a float log2 misbins values next to powers of two).
        key = _as_fp32(x).view(torch.int32) & _ABS_MASK  # |x| as bits; monotone in |x|
        biased = key >> 23
        bins = biased + (-127 - E_MIN)  # normal: floor(log2|x|) = biased - 127, and bin = floor(log2|x|) - E_MIN
        # subnormal: |x| = m * 2^-149 with integer m = key, so floor(log2|x|) = floor(log2 m) - 149, and
        # floor(log2 m) is the exponent of float(m) (exact: m < 2^23)
        sub = (key.float().view(torch.int32) >> 23) - (127 + 149 + E_MIN)
        bins = torch.where(biased == 0, sub, bins)
        nonfinite = biased == 255
        bins.masked_fill_(key == 0, _ZERO_BIN).masked_fill_(nonfinite, _INF_BIN)
        bins.masked_fill_(key > _INF_BITS, _NAN_BIN)
        counts = torch.bincount(bins, minlength=N_BINS + 3)
        overflow = None
        if self.track_overflow:
            # above max, inf included; NaN bit patterns are above every max too, so take them back out
            above = torch.stack([torch.count_nonzero(key > _MAX_BITS[fmt.name]) for fmt in _OVERFLOW_FORMATS])
            overflow = above - counts[_NAN_BIN]
        max_abs = key.masked_fill_(nonfinite, 0).amax().view(torch.float32).double()
        self._fold(also, counts, overflow, max_abs, x.numel())

    def _add_subset(self, x: torch.Tensor, also: tuple[DeviceHistogram, ...]) -> None:
        """Bin a strided subset of ``x``; take the largest finite magnitude from the whole tensor in one
        vectorised pass (the int32 bit arithmetic of the binning is ~25x slower per element). No host sync."""
        stride = _prime_at_least(x.numel() // self.bin_limit)
        part = DeviceHistogram(self.device, track_overflow=self.track_overflow)
        part.add(x[::stride])
        full_max = torch.linalg.vector_norm(x, float("inf")).double()  # inf or NaN when any value is
        finite = torch.isfinite(full_max)
        max_abs = torch.where(finite, full_max, part.max_abs)
        counts = part.counts
        # a non-finite value outside the subset still counts: at least one, so no reader misses it
        counts[_INF_BIN] = torch.maximum(counts[_INF_BIN], (~finite).long() - counts[_NAN_BIN])
        if self.track_overflow:
            part.overflow.copy_(torch.maximum(part.overflow, (~finite).long()))
        self._fold(also, counts, part.overflow, max_abs, part.total)

    def _fold(self, also: tuple[DeviceHistogram, ...], counts, overflow, max_abs, total: int) -> None:
        """Add one tensor's counts, overflow counts (None: not tracked) and largest magnitude to this histogram
        and to each of ``also``."""
        for h in (self, *also):
            h.counts += counts
            if overflow is not None:
                h.overflow += overflow
            h.max_abs = torch.maximum(h.max_abs, max_abs)
            h.total += total

    def _packed(self) -> torch.Tensor:
        # float64 holds every count exactly up to 2^53 elements
        counts = self.counts.double()
        nonfinite = counts[_INF_BIN] + counts[_NAN_BIN]
        return torch.cat([counts[: N_BINS + 1], nonfinite.reshape(1), self.max_abs.reshape(1), self.overflow.double()])


def _prime_at_least(n: int) -> int:
    """The smallest prime >= n (>= 1): a prime stride never lines up with a tensor's row length (a power of
    two, or a multiple of 3), so the strided subset walks across features instead of down one column."""
    if n <= 2:
        return max(n, 1)
    n |= 1
    while any(n % d == 0 for d in range(3, int(n**0.5) + 1, 2)):
        n += 2
    return n


def to_host(hists: Sequence[DeviceHistogram]) -> list[LogHistogram]:
    """Copy many device histograms to the host in one transfer. Forces exactly one host sync."""
    if not hists:
        return []
    packed = torch.stack([h._packed() for h in hists]).cpu().tolist()
    out = []
    for h, row in zip(hists, packed):
        counts = [int(c) for c in row[:N_BINS]]
        zeros, nonfinite, max_abs = int(row[N_BINS]), int(row[N_BINS + 1]), float(row[N_BINS + 2])
        # row[N_BINS + 3 :] holds the overflow counts; zero when track_overflow was off
        overflow = {fmt.name: int(c) for fmt, c in zip(_OVERFLOW_FORMATS, row[N_BINS + 3 :])}
        out.append(LogHistogram(counts, zeros, nonfinite, h.total, max_abs, overflow))
    return out


@dataclass
class LogHistogram:
    """A host-side log2-magnitude histogram: ``counts[i]`` values had floor(log2|x|) == ``E_MIN + i``."""

    counts: list[int] = field(default_factory=lambda: [0] * N_BINS)
    zeros: int = 0
    """Exact zeros (not underflow: fp16 represents them)."""
    nonfinite: int = 0
    """inf and NaN values already present in fp32."""
    total: int = 0
    """Every element seen, zeros and non-finite included."""
    max_abs: float = 0.0
    """Largest finite magnitude seen."""
    overflow: dict[str, int] = field(default_factory=dict)
    """Per format name: elements with |x| above that format's max (inf included)."""

    @property
    def nonzero(self) -> int:
        """Nonzero finite values: the denominator of the underflow and subnormal fractions."""
        return sum(self.counts)

    def count_below(self, exp: int) -> int:
        """Nonzero finite values with |x| < 2^exp."""
        return sum(self.counts[: max(0, min(N_BINS, exp - E_MIN))])

    def underflow_fraction(self, fmt: FloatFormat, scale_exp: int = 0) -> float:
        """Fraction of nonzero finite values that ``fmt`` would flush to zero after multiplying by 2^scale_exp.

        Counted as |x| * 2^scale_exp < the format's smallest subnormal. (Round-to-nearest keeps the upper half
        of that last binade as the smallest subnormal, with up to 50% error; counting it as lost is the
        conservative reading the issue asks for.)
        """
        n = self.nonzero
        return self.count_below(fmt.min_subnormal_exp - scale_exp) / n if n else 0.0

    def subnormal_fraction(self, fmt: FloatFormat, scale_exp: int = 0) -> float:
        """Fraction of nonzero finite values that ``fmt`` holds only as subnormals after scaling by 2^scale_exp."""
        n = self.nonzero
        lo, hi = fmt.min_subnormal_exp - scale_exp, fmt.min_normal_exp - scale_exp
        return (self.count_below(hi) - self.count_below(lo)) / n if n else 0.0

    def overflow_fraction(self, fmt: FloatFormat) -> float:
        """Fraction of all elements (zeros included) above ``fmt``'s max."""
        return self.overflow.get(fmt.name, 0) / self.total if self.total else 0.0

    def merge(self, other: LogHistogram) -> LogHistogram:
        """The histogram of both sets of values."""
        return LogHistogram(
            [a + b for a, b in zip(self.counts, other.counts)],
            self.zeros + other.zeros,
            self.nonfinite + other.nonfinite,
            self.total + other.total,
            max(self.max_abs, other.max_abs),
            {k: self.overflow.get(k, 0) + other.overflow.get(k, 0) for k in {*self.overflow, *other.overflow}},
        )

    def quantile_exp(self, q: float) -> int | None:
        """The binary exponent e of the q-quantile of the nonzero finite magnitudes (the smallest e with more
        than a fraction q of them in bins <= e), or None when there are none. ``q=0.01`` is the "smallest
        significant value" the precision watch measures underflow headroom from: the lowest 1% is the tail a
        format may lose without the layer noticing."""
        n = self.nonzero
        if not n:
            return None
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen > q * n:
                return E_MIN + i
        return E_MIN + N_BINS - 1  # unreachable: seen == n > q * n by the last bin

    def overflow_headroom(self, fmt: FloatFormat) -> float | None:
        """Binades between the largest finite magnitude and ``fmt``'s max: log2(max / max_abs), negative for
        values held in a wider format that ``fmt`` could not hold. At most 0 when some values are inf or NaN
        (an fp16 overflow leaves no finite maximum to measure); None when there is no nonzero value at all."""
        if not self.max_abs > 0:
            return 0.0 if self.nonfinite else None
        headroom = math.log2(fmt.max) - math.log2(self.max_abs)
        return min(headroom, 0.0) if self.nonfinite else headroom

    def underflow_headroom(self, fmt: FloatFormat, q: float = 0.01) -> int | None:
        """Binades between the smallest significant magnitude (:meth:`quantile_exp` of ``q``) and ``fmt``'s
        smallest normal; negative when more than a fraction q of the values are already subnormal or lost."""
        e = self.quantile_exp(q)
        return None if e is None else e - fmt.min_normal_exp

    def outside_normal_fraction(self, fmt: FloatFormat) -> float:
        """Fraction of nonzero finite values below ``fmt``'s smallest normal (subnormal or flushed to zero)."""
        n = self.nonzero
        return self.count_below(fmt.min_normal_exp) / n if n else 0.0

    def exponent_range(self) -> tuple[int, int] | None:
        """(lowest, highest) populated exponent, or None when there are no nonzero finite values."""
        populated = [i for i, c in enumerate(self.counts) if c]
        return (E_MIN + populated[0], E_MIN + populated[-1]) if populated else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the counts trimmed to the populated exponents: ``counts[i]`` is for 2^(min_exp+i)."""
        rng = self.exponent_range()
        lo, hi = rng if rng else (0, -1)
        return {
            "min_exp": lo,
            "counts": self.counts[lo - E_MIN : hi - E_MIN + 1],
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
            "total": self.total,
            "max_abs": self.max_abs,
        }
