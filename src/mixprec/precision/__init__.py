"""Precision strategies and the registry that parses their names."""

from mixprec.precision.base import Precision, PrecisionNotSupportedError
from mixprec.precision.decision import AutoDecision
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import AutocastMixedPrecision, Bf16MixedPrecision, Fp16MixedPrecision
from mixprec.precision.registry import (
    auto_candidates,
    available_precisions,
    canonical_name,
    make_precision,
    register_precision,
    resolve_precision,
)

__all__ = [
    "AutoDecision",
    "AutocastMixedPrecision",
    "Bf16MixedPrecision",
    "Fp16MixedPrecision",
    "FullPrecision",
    "Precision",
    "PrecisionNotSupportedError",
    "auto_candidates",
    "available_precisions",
    "canonical_name",
    "make_precision",
    "register_precision",
    "resolve_precision",
]
