"""Full precision: fp32 everywhere. The null object of the precision strategies."""

from __future__ import annotations

from mixprec.precision.base import Precision


class FullPrecision(Precision):
    """fp32 compute, fp32 parameters, no loss scaling. Every hook is the base behaviour."""

    name = "fp32"
    auto_candidate = True
    safety_rank = 0
