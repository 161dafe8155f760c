"""TrainingArguments' three precision fields, one mode: ``precision`` (a name, or a Precision made at the edge) and
HF's ``fp16`` / ``bf16`` flags, which are sugar for a name.

:func:`resolve` runs at construction: the name is written back to ``precision`` (what ``to_dict``, JSON and YAML
write) and the flags are made truthful (code reading ``args.fp16`` sees what will run). A script may edit a field
afterwards, as HF scripts do (``args.fp16 = True`` after parsing); :func:`sync` (from ``validate()``, which the
Trainer calls, and from the ``precision_config`` view) resolves again, and the field that changed decides: an
edited flag as HF's flag would, an edited ``precision`` over the flags it made. Both edited must agree.
"""

from __future__ import annotations

from typing import Any

from mixprec.accelerator.step_in_backward import REFUSALS, fit_for_step_in_backward
from mixprec.precision.base import Precision
from mixprec.precision.registry import canonical_name, hf_flags, needs_loss_scaling, policy_name, recompute_refusal
from mixprec.trainer.configs import fail


def resolve(args: Any) -> None:
    """The mode the three fields of ``args`` (a TrainingArguments) name, checked against the fields that depend
    on it; one-line errors name the field and the fix."""
    if args.fp16 and args.bf16:
        fail("bf16", args.bf16, "fp16=True and bf16=True were both set; choose one (or set precision=...)")
    flag = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    given = args.precision if args.precision is not None else flag or "fp32"
    strategy = args._strategy = given if isinstance(given, Precision) else None  # made at the edge (mixprec train)
    try:
        name = given.name if isinstance(given, Precision) else canonical_name(given)
    except (TypeError, ValueError) as err:
        raise ValueError(f"TrainingArguments(precision={given!r}): {err}") from None
    if args.fp32_ops:
        try:
            name = canonical_name(policy_name(name, args.fp32_ops, made=strategy))
        except ValueError as err:
            raise ValueError(f"TrainingArguments(fp32_ops={args.fp32_ops!r}): {err}") from None
        args.fp32_ops = None  # folded into the name: one source of truth from here on
    flags = strategy.hf_flags if strategy is not None else hf_flags(name)  # the mode's own answer
    if flag is not None and flags != (args.fp16, args.bf16):
        fail("precision", given, f"conflicts with {flag}=True; set one of them (or precision=None)")
    args.precision = name
    args.fp16, args.bf16 = flags
    args._resolved = (name, *flags)
    if args.step_in_backward and not (  # "auto" races without fp16 (fit_for_step_in_backward leaves it out)
        fit_for_step_in_backward(strategy) if strategy is not None else not needs_loss_scaling(name)
    ):
        fail("step_in_backward", True, f"with precision={name!r}: {REFUSALS['fp16']}")
    if args._hf_rules.checkpointing_requested()[0]:  # a policy's fp32 regions do not survive the recompute
        why = strategy.recompute_refusal if strategy is not None else recompute_refusal(name)
        if why:
            fail("activation_checkpointing", True, f"with precision={name!r}: {why}")


def sync(args: Any) -> None:
    """Resolve again after a field was edited since the last resolution (nothing to do otherwise)."""
    resolved = args.__dict__.get("_resolved")
    if resolved is None or (args.precision, args.fp16, args.bf16) == resolved:
        return
    precision_edited = args.precision is not resolved[0] and args.precision != resolved[0]
    flags_edited = (args.fp16, args.bf16) != resolved[1:]
    if flags_edited and not precision_edited:
        args.precision = None  # the flags decide, as HF's
    elif precision_edited and not flags_edited:
        args.fp16 = args.bf16 = False  # the precision decides; its flags follow
    resolve(args)
