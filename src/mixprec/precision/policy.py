"""An autocast mode with named op kinds kept in fp32: "bf16:fp32_ops=attention" (issue 23).

The strategy is the autocast mode it refines (a bf16 policy *is* a bf16 mode: fp32 master weights, the same
scaler, the same step) with one hook changed: ``autocast()`` adds :class:`~mixprec.precision.op_policy.
Fp32Regions` for the named kinds. Built from the policy's spelling (:func:`make_policy`), never registered as
a name of its own (the kinds make the name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from mixprec.precision.mixed import AutocastMixedPrecision, Bf16MixedPrecision, Fp16MixedPrecision
from mixprec.precision.op_policy import (
    AUTOCAST_DEFAULT,
    OP_KINDS,
    OpPolicy,
    check_op_kinds,
    policy_autocast,
)

_RECOMPUTE = (  # why: PolicyMixedPrecision.backward
    "the recompute in backward does not run the policy's fp32 regions; turn activation (gradient) "
    "checkpointing off or use precision={base!r}"
)


class PolicyMixedPrecision(AutocastMixedPrecision):
    """Autocast in ``compute_dtype`` with ``policy.fp32_ops`` held in fp32. ``name`` is the policy's spelling."""

    # Chosen by measurement (mixprec.precision.op_timing), not raced as a registered name.
    auto_candidate = False
    base_name: ClassVar[str] = ""

    def __init__(self, fp32_ops: Iterable[str], device: torch.device | str | None = None, reason: str = "") -> None:
        self.policy = OpPolicy(self.base_name, check_op_kinds(fp32_ops))
        self.name = self.policy.spec  # type: ignore[misc]  # the instance's name: the class's is its base
        super().__init__(device, reason)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return policy_autocast(self.policy, self.device.type, self.compute_dtype)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The base mode's backward. Activation checkpointing recomputes the forward inside backward, where
        torch restores autocast but not the policy's torch function mode (measured on torch 2.13: the mode
        is not seen by the recompute even when active around ``backward``), so the recompute runs the fp32
        kinds in low precision and torch's metadata check fails: said here in one line, with the fix. No
        host sync."""
        from torch.utils.checkpoint import CheckpointError

        try:
            super().backward(loss, **kwargs)
        except CheckpointError as err:
            raise RuntimeError(
                f"precision {self.name!r} with activation checkpointing: {self.recompute_refusal}"
            ) from err

    @property
    def matmul_dtype(self) -> torch.dtype:
        return torch.float32 if "linear" in self.policy.fp32_ops else self.compute_dtype

    def op_dtypes(self) -> dict[str, str]:
        """Each op kind's dtype under this policy: "fp32 (policy)" or what autocast does with it here."""
        low = str(self.compute_dtype).removeprefix("torch.")
        defaults = AUTOCAST_DEFAULT.get(self.device.type, AUTOCAST_DEFAULT["cuda"])
        return {
            kind: "fp32 (policy)" if kind in self.policy.fp32_ops else defaults[kind].replace("low precision", low)
            for kind in OP_KINDS
        }

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "fp32_ops": sorted(self.policy.fp32_ops), "op_dtypes": self.op_dtypes()}


class Bf16PolicyPrecision(PolicyMixedPrecision, Bf16MixedPrecision):
    """bf16 autocast with named op kinds in fp32."""

    base_name = "bf16"
    recompute_refusal = _RECOMPUTE.format(base="bf16")
    # between fp32 and uniform bf16: it holds more in fp32 than bf16 does. auto's race takes a mode only when
    # it beats every safer one, so the policy must beat fp32 and uniform bf16 must beat the policy; with the
    # policy after bf16, a policy clearly faster than fp32 but within noise of bf16 lost to fp32 (both undecided)
    safety_rank = 0.5  # type: ignore[assignment]


class Fp16PolicyPrecision(PolicyMixedPrecision, Fp16MixedPrecision):
    """fp16 autocast (with loss scaling) with named op kinds in fp32."""

    base_name = "fp16"
    recompute_refusal = _RECOMPUTE.format(base="fp16")
    safety_rank = 1.5  # type: ignore[assignment]  # between bf16 and uniform fp16, as the bf16 policy's


POLICY_BASES: dict[str, type[PolicyMixedPrecision]] = {"bf16": Bf16PolicyPrecision, "fp16": Fp16PolicyPrecision}


def make_policy(spec: str, device: torch.device | str | None = None) -> PolicyMixedPrecision:
    """The strategy for a policy's spelling, ``"bf16:fp32_ops=attention"``, its base a canonical mode name.
    The registry canonicalises a user's spelling (aliases, case) before calling this; "auto"'s race and the
    op timing hand it the spellings they made, so they need not import the registry (which imports them)."""
    policy = OpPolicy.parse(spec)
    if policy.base not in POLICY_BASES:
        raise ValueError(
            f"precision {spec!r}: a policy refines an autocast mode; start it with "
            f"{' or '.join(repr(b + ':') for b in POLICY_BASES)}"
        )
    return POLICY_BASES[policy.base](policy.fp32_ops, device)


def recorded_policy(name: str, bases: Iterable[str], device: torch.device | str) -> PolicyMixedPrecision | None:
    """The policy a record names (a cached race's decision, a checkpoint's) as a strategy, where "auto" could
    have measured it: a policy whose base mode is one of ``bases`` (auto's candidates' names); None for any
    other name. auto's candidates are the registered modes, so a policy it measured must be made again."""
    return make_policy(name, device) if ":" in name and name.split(":")[0] in set(bases) else None


def recomputes_activations(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the module a wrapper holds: DDP's ``module``, torch.compile's ``_orig_mod``) has
    activation (gradient) checkpointing on, by HF's flag (mixprec's GPT has it too): what a policy cannot train
    (``recompute_refusal``). A hand-made ``torch.utils.checkpoint`` call inside a forward is not seen; a policy
    then fails on its first backward, naming the fix."""
    inner = [model, getattr(model, "module", None), getattr(model, "_orig_mod", None)]
    return any(_recomputes(m) for m in inner if m is not None)


def _recomputes(module: torch.nn.Module) -> bool:
    # HF 5's name first: its old one, still on every HF 5 model, warns that it goes in v6
    flag = getattr(module, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else getattr(module, "is_gradient_checkpointing", False))
