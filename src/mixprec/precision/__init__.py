"""Precision strategies and the registry that parses their names."""

from mixprec.precision.base import Precision, PrecisionNotSupportedError
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import AutocastMixedPrecision, Bf16MixedPrecision, Fp16MixedPrecision
from mixprec.precision.registry import (
    available_precisions,
    canonical_name,
    register_precision,
    resolve_precision,
)

__all__ = [
    "AutocastMixedPrecision",
    "Bf16MixedPrecision",
    "Fp16MixedPrecision",
    "FullPrecision",
    "Precision",
    "PrecisionNotSupportedError",
    "available_precisions",
    "canonical_name",
    "register_precision",
    "resolve_precision",
]
