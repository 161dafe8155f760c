"""The verdicts of auto's race (race.py) on paired samples: how much faster one mode is than a safer one, with
what confidence, and which mode that makes the choice.

Samples are paired by round (round i of each mode ran back to back), so a neighbour's burst slows one pair,
not one mode's whole median. From 6 pairs the interval is the sign test's (order statistics: bursts are
outliers that only add time, not Gaussian noise); from ``EARLY_ROUNDS`` to 5 pairs, a 95% t-interval of the
log ratios, which only a clear and steady gap clears (a burst widens it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

MARGIN = 0.05  # a lower precision must be at least 5% faster than every safer one
# the t-interval's first pairs: it matters most in a race run as the training steps, where every round costs the
# gap itself (issue 23: GPT-2 124M on a CPU, fp32's steps 1.5 s slower than bf16's)
EARLY_ROUNDS = 3
_T95 = {2: 4.303, 3: 3.182, 4: 2.776}  # Student's t, two-sided 95% (the sign test's level), by degrees of freedom
WINS, NOT_FASTER, UNDECIDED = "wins", "not faster", "undecided"


def _sign_rank(n: int) -> int:
    """The rank k (1-based) such that the k-th smallest and k-th largest of n samples bound their median with
    at least 95% confidence (the sign test's interval: distribution-free); 0 when n is too small (< 6)."""
    k, below = 0, 0.0
    for j in range(n + 1):
        below += math.comb(n, j) / 2**n
        if below > 0.025:
            break
        k = j + 1
    return k


def speedup_interval(mode: Sequence[float], safer: Sequence[float]) -> tuple[float, float, float]:
    """``safer``'s time over ``mode``'s from paired samples (round i of each): the median ratio and a 95%
    interval of it (low, median, high), the sign test's or the t-interval of the module docstring; above 1 means
    ``mode`` is faster. (0, median, inf) below ``EARLY_ROUNDS`` pairs."""
    n = min(len(mode), len(safer))
    ratios = sorted(s / m for m, s in zip(mode[:n], safer[:n]) if m > 0 and s > 0)
    if not ratios:
        return (0.0, 1.0, math.inf)
    k = _sign_rank(len(ratios))
    if k == 0 and len(ratios) - 1 in _T95:  # EARLY_ROUNDS..5 pairs: the t-interval of the log ratios
        logs = [math.log(r) for r in ratios]
        half = _T95[len(logs) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
        mean = statistics.fmean(logs)
        return (math.exp(mean - half), statistics.median(ratios), math.exp(mean + half))
    if k == 0:
        return (0.0, statistics.median(ratios), math.inf)
    return (ratios[k - 1], statistics.median(ratios), ratios[-k])


def verdict(mode: Sequence[float], safer: Sequence[float]) -> str:
    """Whether ``mode`` is faster than ``safer`` by ``MARGIN`` on their paired samples: ``WINS`` when the
    whole 95% interval of the time ratio is below ``1 - MARGIN``, ``NOT_FASTER`` when it is whole above it
    (within the margin or slower: a tie, which goes to the safer mode), ``UNDECIDED`` otherwise."""
    low, _, high = speedup_interval(mode, safer)  # speedups: a time ratio of 1/speedup
    bar = 1 / (1 - MARGIN)
    if low > bar:
        return WINS
    if high < bar:
        return NOT_FASTER
    return UNDECIDED


def choose_paired(order: Sequence[str], samples: dict[str, list[float]], dropped: Mapping[str, int]) -> str:
    """The least safe mode that wins (:func:`verdict`) against every safer mode still racing at the end;
    the safest mode if none does. ``order`` is safest first; dropped modes lost to the safest already. A
    pair still undecided when the rounds ran out is a tie, the safer mode's. (Settling it by the best times
    instead was tried: with bf16 1.05-1.17x faster on a busy box, the flip point sat inside that range and
    10 fresh races split 5/5; undecided-to-the-safer split 8/2 and 10/0: benchmarks/README.md.)"""
    timed = [name for name in order if samples.get(name) and name not in dropped]
    if not timed:
        return order[0]
    best = timed[0]
    for i, name in enumerate(timed[1:], start=1):
        if all(verdict(samples[name], samples[s]) == WINS for s in timed[:i]):
            best = name
    return best


def choose(order: Sequence[str], medians: dict[str, float], minima: dict[str, float]) -> str:
    """For unpaired measurements (the probe's stand-in workload): the safest mode, unless a less safe one
    beats the current pick by ``MARGIN`` on the median time and its best time is lower too (noise only ever
    adds time). The race itself decides on paired samples (:func:`choose_paired`)."""
    timed = [name for name in order if name in medians]
    if not timed:
        return order[0]
    best = timed[0]
    for name in timed[1:]:
        if medians[name] < medians[best] * (1 - MARGIN) and minima[name] < minima[best]:
            best = name
    return best
