"""The one place a precision name is parsed.

Every layer (GradScaler users, the Accelerator, TrainingArguments, the command line) hands its string here
and gets back a :class:`~mixprec.precision.base.Precision` strategy. New modes ("bf16-pure", "fp8") are new
classes registered with :func:`register_precision`, not new branches in callers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.precision import probe
from mixprec.precision.auto import AutoPrecision
from mixprec.precision.base import Precision, PrecisionNotSupportedError, default_device
from mixprec.precision.formats import FloatFormat, format_of
from mixprec.precision.fp8 import Fp8Precision, Fp8RowwisePrecision
from mixprec.precision.full import FullPrecision
from mixprec.precision.mixed import Bf16MixedPrecision, Fp16MixedPrecision
from mixprec.precision.op_policy import OpPolicy, check_op_kinds
from mixprec.precision.policy import POLICY_BASES, make_policy
from mixprec.precision.pure import PureBf16KahanPrecision, PureBf16Precision

_STRATEGIES: dict[str, type[Precision]] = {}
_ALIASES: dict[str, str] = {}
AUTO = "auto"


def register_precision(cls: type[Precision], aliases: tuple[str, ...] = ()) -> type[Precision]:
    """Make ``cls.name`` (and ``aliases``) valid precision names. Returns ``cls`` so it can decorate."""
    _STRATEGIES[cls.name] = cls
    for alias in aliases:
        _ALIASES[alias] = cls.name
    return cls


register_precision(FullPrecision, aliases=("no", "32", "float32", "32-true"))
register_precision(Fp16MixedPrecision, aliases=("16", "float16", "half", "16-mixed", "fp16-mixed"))
register_precision(Bf16MixedPrecision, aliases=("bfloat16", "bf16-mixed"))
register_precision(PureBf16Precision, aliases=("bf16-true", "true-bf16", "bf16-pure-sr"))
register_precision(PureBf16KahanPrecision, aliases=("bf16-true-kahan",))
register_precision(Fp8Precision, aliases=("float8", "fp8-tensorwise"))
register_precision(Fp8RowwisePrecision, aliases=("float8-rowwise",))


def available_precisions() -> list[str]:
    """The names users are shown: "no" first (HF's spelling of fp32), then each mode, then "auto"."""
    return ["no", *_STRATEGIES, AUTO]


def canonical_name(name: str) -> str:
    """Normalise ``name`` to "fp32", "fp16", "bf16", ... or "auto"; raise ValueError listing the valid ones."""
    if not isinstance(name, str):
        raise TypeError(f"precision must be a string, got {type(name).__name__}: {name!r}")
    key = name.strip().lower()
    if ":" in key:  # a per-op-kind policy, "bf16:fp32_ops=attention"
        return _parse_policy(key).spec
    key = _ALIASES.get(key, key)
    if key in _STRATEGIES or key == AUTO:
        return key
    raise ValueError(f"unknown precision {name!r}; choose one of: {', '.join(available_precisions())}")


def resolve_precision(name: str = AUTO, device: torch.device | str | None = None) -> Precision:
    """Return the strategy for ``name`` on ``device`` (default: CUDA if available, else CPU).

    Here, with no training step to measure, "auto" can only *guess* (its ``.reason`` says so): on CUDA bf16
    where the GPU supports it, else fp16; on a CPU the fastest of fp32/bf16/fp16 on a stand-in probe (a
    fraction of a second, cached per process). Code that owns a training step (the Accelerator, the
    Trainer, ``mixprec train`` and ``mixprec bench``) uses :func:`make_precision` instead, whose "auto" is
    measured on that step. Raises :class:`PrecisionNotSupportedError` for a mode the device cannot run.
    """
    key = canonical_name(name)
    dev = _device(device)
    if ":" in key:  # canonical_name has checked the policy's base
        return make_policy(key, dev)
    if key == AUTO:
        Precision.check_supported(dev)  # the device must exist before "auto" reasons about it
        key, reason = _guess_auto(dev)
        return _STRATEGIES[key](dev, reason=reason)
    return _STRATEGIES[key](dev)


def make_precision(name: str = AUTO, device: torch.device | str | None = None, *, processes: int = 1) -> Precision:
    """The strategy for ``name`` where a training step exists: "auto" becomes an
    :class:`~mixprec.precision.auto.AutoPrecision` that races :func:`auto_candidates` on the first step."""
    if canonical_name(name) != AUTO:
        return resolve_precision(name, device)
    dev = _device(device)
    Precision.check_supported(dev)
    return AutoPrecision(auto_candidates(dev), processes=processes)


def precision_for(
    precision: str | Precision, device: torch.device | str | None = None, *, processes: int = 1
) -> Precision:
    """The strategy a training loop runs: a name parsed by :func:`make_precision`, or a strategy already
    made (``make_precision("bf16")``, an ``AutoPrecision``: parsed at the edge, e.g. by the command line)
    used as it is, bound to ``device`` and ``processes`` (:meth:`Precision.bind`). No name is parsed twice."""
    if isinstance(precision, Precision):
        precision.bind(_device(device), processes)
        return precision
    return make_precision(precision, device, processes=processes)


def needs_loss_scaling(name: str) -> bool:
    """Whether the mode ``name`` scales the loss (fp16 and its policies), e.g. a run summary's precision;
    False for "auto" (undecided: it scales nothing yet)."""
    key = canonical_name(name)
    return key != AUTO and _class_of(key).needs_loss_scaling


def recompute_refusal(name: str) -> str:
    """Why the mode ``name`` cannot train a model with activation checkpointing on, or "" where it can (a
    per-op policy cannot). Asked of a name at the edge; a strategy answers it itself
    (:attr:`Precision.recompute_refusal`)."""
    key = canonical_name(name)
    return "" if key == AUTO else _class_of(key).recompute_refusal


def hf_flags(name: str) -> tuple[bool, bool]:
    """HF's ``(fp16, bf16)`` flags for the mode ``name``: the fp16 / bf16 autocast mode or a policy refining it
    ("bf16:fp32_ops=attention" is bf16); both False for fp32, pure bf16, fp8 and an undecided "auto". A
    strategy answers it itself (:attr:`Precision.hf_flags`)."""
    key = canonical_name(name)
    return (False, False) if key == AUTO else _class_of(key).hf_flags  # a policy's class is its base mode's


_AUTOCAST_MODES: tuple[type[Precision], ...] = (Fp16MixedPrecision, Bf16MixedPrecision)
"""The plain autocast modes, in the order a diagnosis tries them (fp16 first: the narrower range)."""


def autocast_format(precision: Precision) -> FloatFormat | None:
    """The number format of the plain autocast mode ``precision`` is (fp16 or bf16 autocast: what a diagnosis
    judges it by), None for any other mode (fp32, a policy, pure bf16, fp8, "auto")."""
    mode = precision.resolved  # "auto", once decided, is its choice
    return mode.compute_format if type(mode) in _AUTOCAST_MODES else None


@dataclass(frozen=True)
class AutocastMode:
    """One plain autocast mode as a diagnosis judges it on a device: its format, and either the strategy to run
    it under or why the device cannot. The facts come from the strategy class, so a caller never looks a
    precision up by its name (issue 35); ``name`` is only the label its verdicts are printed under."""

    name: str
    """The mode's name ("fp16", "bf16"): a label for reports and messages, not a key to look facts up by."""
    format: FloatFormat
    """The format it computes in (its range, whether it scales the loss)."""
    precision: Precision | None
    """The strategy, made for the device; None when the device cannot run it."""
    unsupported: str | None
    """Why the device cannot run it (the strategy's own refusal); None when it can."""


def autocast_modes(device: torch.device) -> list[AutocastMode]:
    """The plain autocast modes (fp16 and bf16 mixed) on ``device``, in the order a diagnosis tries them, each
    with its format and its strategy or why the device refuses it: a mode the device cannot run is still
    listed (the diagnosis says why it was not chosen), never silently dropped."""
    out = []
    for cls in _AUTOCAST_MODES:
        try:
            made, why = cls(device, reason=f"judged by a diagnosis on {device.type}"), None
        except PrecisionNotSupportedError as e:
            made, why = None, str(e)
        out.append(AutocastMode(cls.name, format_of(cls.compute_dtype), made, why))
    return out


def _class_of(key: str) -> type[Precision]:
    """The strategy class of a canonical name other than "auto" (a policy's class for a policy)."""
    return POLICY_BASES[OpPolicy.parse(key).base] if ":" in key else _STRATEGIES[key]


def auto_candidates(device: torch.device) -> list[Precision]:
    """The registered modes "auto" may pick on ``device`` (those declaring ``auto_candidate`` that the device
    runs), safest first."""
    out = []
    for cls in sorted(_STRATEGIES.values(), key=lambda c: c.safety_rank):
        if not cls.auto_candidate:
            continue
        try:
            out.append(cls(device, reason=f"auto candidate on {device.type}"))
        except PrecisionNotSupportedError:
            continue
    return out


def policy_name(name: str, fp32_ops: str | list[str] | tuple[str, ...] | None, *, made: Precision | None = None) -> str:
    """The precision name for ``name`` with ``fp32_ops`` kept in fp32 (the ``fp32_ops=`` argument of the
    Accelerator, TrainingArguments and ``mixprec train``): ``("bf16", ["attention"])`` ->
    "bf16:fp32_ops=attention" (a policy ``name`` keeps its own kinds too); ``name`` unchanged when ``fp32_ops`` is
    empty. Raises a ValueError naming ``fp32_ops`` for an unknown kind, a mode without autocast, or beside a
    strategy already ``made`` (named ``name``: its kinds belong in its name)."""
    kinds = check_op_kinds(fp32_ops or ())
    if not kinds:
        return name
    if made is not None:
        raise ValueError(
            f"fp32_ops={sorted(kinds)} with a precision strategy ({made.name!r}): name the kinds in it, "
            f"make_precision('{made.name}:fp32_ops={','.join(sorted(kinds))}'), and drop fp32_ops"
        )
    base = canonical_name(name)
    if ":" in base:  # a policy's own kinds stay, joined by these
        named = OpPolicy.parse(base)
        base, kinds = named.base, frozenset(kinds) | named.fp32_ops
    if base not in POLICY_BASES:
        raise ValueError(
            f"fp32_ops={sorted(kinds)} needs an autocast mode to refine, not precision {name!r}; "
            f"use precision={' or '.join(repr(b) for b in POLICY_BASES)}"
        )
    return OpPolicy(base, kinds).spec


def _parse_policy(key: str) -> OpPolicy:
    policy = OpPolicy.parse(key)
    base = canonical_name(policy.base) if ":" not in policy.base else policy.base
    if base not in POLICY_BASES:
        raise ValueError(
            f"precision {key!r}: a policy refines an autocast mode; start it with "
            f"{' or '.join(repr(b + ':') for b in POLICY_BASES)}"
        )
    return OpPolicy(base, policy.fp32_ops)


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else default_device()


def _guess_auto(device: torch.device) -> tuple[str, str]:
    guessed = "guessed without a training step to measure"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", f"auto on cuda {guessed}: the GPU supports bf16, which needs no loss scaling"
        return "fp16", f"auto on cuda {guessed}: no native bf16 on this GPU, so fp16 with loss scaling"
    if device.type == "cpu":
        result = probe.cpu_probe()  # through the module: a test (or a user) may replace it there
        return result.chosen, f"{result.explain()} ({guessed}: a stand-in for your model)"
    try:
        Fp16MixedPrecision.check_supported(device)
    except PrecisionNotSupportedError:
        return "fp32", f"auto on {device.type}: torch has no autocast here, so fp32"
    return "fp16", f"auto on {device.type} {guessed}: fp16 autocast with loss scaling"
