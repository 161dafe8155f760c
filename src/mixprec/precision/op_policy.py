"""Precision per kind of operation: which op kinds an autocast mode keeps in fp32 (issue 23).

torch's autocast runs a static list of ops in low precision on every device. On a Zen 4 CPU (avx512_bf16)
the bf16 ``scaled_dot_product_attention`` backward takes ~12 ms per call against fp32's ~3 ms while bf16
matmuls run at 2x fp32's, so uniform bf16 buys the main job nothing (1.05x) and bf16 with attention kept
in fp32 buys 1.45x. An :class:`OpPolicy` names the op kinds to keep in fp32; :class:`Fp32Regions` applies
it inside autocast.

How: a ``TorchFunctionMode`` sees each torch function the model calls (``F.scaled_dot_product_attention``,
``F.linear`` through ``nn.Linear``, ``x @ y``...), however the model imported it; a call of a kind held in
fp32 runs with autocast disabled on fp32-cast inputs. Everything else goes to autocast untouched. The mode
costs a Python call per torch function in the forward (microseconds; the backward is not touched). A torch
function called *inside* another one that has its own override (``F.multi_head_attention_forward``'s inner
linears) follows its caller's kind, since torch disables the mode while the outer one runs.

The one spelling of a policy, parsed here and shown in every record: ``"bf16:fp32_ops=attention,norm"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

# The op kinds a policy can name, with the torch functions each covers. Tensor methods and operators
# reach __torch_function__ as torch.Tensor attributes.
OP_KINDS: dict[str, tuple[Any, ...]] = {
    "linear": (
        F.linear,
        F.bilinear,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.addbmm,
        torch.einsum,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.Tensor.mm,
        torch.Tensor.bmm,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
    ),
    "attention": (F.scaled_dot_product_attention, F.multi_head_attention_forward),
    "norm": (F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.rms_norm, F.normalize),
    "softmax": (
        F.softmax,
        F.log_softmax,
        torch.softmax,
        torch.log_softmax,
        torch.Tensor.softmax,
        torch.Tensor.log_softmax,
        F.cross_entropy,
        F.nll_loss,
    ),
    "embedding": (F.embedding, F.embedding_bag),
    "activation": (
        F.gelu,
        F.relu,
        F.silu,
        F.mish,
        F.elu,
        F.leaky_relu,
        F.softplus,
        F.tanh,
        F.sigmoid,
        torch.tanh,
        torch.sigmoid,
        torch.relu,
        torch.Tensor.tanh,
        torch.Tensor.sigmoid,
        torch.Tensor.relu,
    ),
}

# What torch's autocast already does with each kind when the policy leaves it alone (torch's op lists in
# aten/src/ATen/autocast_mode.cpp; the CPU entries checked on torch 2.13). describe() shows this, so a
# user does not ask for fp32 where autocast already gives it.
AUTOCAST_DEFAULT: dict[str, dict[str, str]] = {
    "cpu": {
        "linear": "low precision (autocast's lower-precision list)",
        "attention": "low precision (autocast's lower-precision list)",
        "norm": "the input's dtype (not on CPU autocast's lists)",
        "softmax": "softmax: the input's dtype; cross_entropy / nll_loss: fp32 (CPU autocast's fp32 list)",
        "embedding": "fp32 (weights are fp32 and autocast leaves it alone)",
        "activation": "the input's dtype (not on autocast's lists)",
    },
    "cuda": {
        "linear": "low precision (autocast's lower-precision list)",
        "attention": "low precision (autocast's lower-precision list)",
        "norm": "layer_norm / group_norm: fp32 (autocast's fp32 list); batch_norm: the input's dtype",
        "softmax": "fp32 (autocast's fp32 list)",
        "embedding": "fp32 (weights are fp32 and autocast leaves it alone)",
        "activation": "the input's dtype (not on autocast's lists)",
    },
}

_KIND_OF: dict[Any, str] = {fn: kind for kind, fns in OP_KINDS.items() for fn in fns}
_SPEC_KEY = "fp32_ops"


def check_op_kinds(kinds: Iterable[str], where: str = "fp32_ops") -> frozenset[str]:
    """Normalise ``kinds`` (case, spaces; "all" for every kind) or raise a one-line ValueError naming
    ``where`` and the valid kinds."""
    if isinstance(kinds, str):
        kinds = [k for k in kinds.split(",") if k.strip()]
    out = set()
    for kind in kinds:
        key = str(kind).strip().lower()
        if key == "all":
            out.update(OP_KINDS)
        elif key in OP_KINDS:
            out.add(key)
        else:
            raise ValueError(f"{where}: unknown op kind {kind!r}; choose from: {', '.join(OP_KINDS)} (or all)")
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class OpPolicy:
    """An autocast mode (``base``: "bf16" or "fp16") with the op kinds it keeps in fp32."""

    base: str
    fp32_ops: frozenset[str]

    @property
    def spec(self) -> str:
        """The policy's one spelling, e.g. "bf16:fp32_ops=attention" (kinds in OP_KINDS order)."""
        return f"{self.base}:{_SPEC_KEY}={','.join(k for k in OP_KINDS if k in self.fp32_ops)}"

    @classmethod
    def parse(cls, spec: str) -> OpPolicy:
        """``"bf16:fp32_ops=attention,norm"`` -> OpPolicy. The base is left for the registry to check."""
        base, _, rest = spec.partition(":")
        key, eq, value = rest.partition("=")
        if key.strip().lower() != _SPEC_KEY or not eq:
            raise ValueError(
                f"precision {spec!r}: a policy is spelled '<mode>:{_SPEC_KEY}=<kind>[,<kind>...]', e.g. "
                f"'bf16:{_SPEC_KEY}=attention'; kinds: {', '.join(OP_KINDS)}"
            )
        kinds = check_op_kinds(value, where=f"precision {spec!r}")
        if not kinds:
            raise ValueError(f"precision {spec!r}: name at least one op kind after '{_SPEC_KEY}='")
        return cls(base.strip().lower(), kinds)


class Fp32Regions(TorchFunctionMode):
    """Run the torch functions of ``kinds`` with autocast off on fp32-cast inputs (inside an autocast region).
    No host sync; one Python call per torch function while active."""

    def __init__(self, kinds: frozenset[str], device_type: str) -> None:
        super().__init__()
        self.fns = frozenset(fn for kind in kinds for fn in OP_KINDS[kind])
        self.device_type = device_type

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.fns:
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(torch.Tensor, _up, (args, kwargs))
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 and t.dtype != torch.float64 else t


@contextlib.contextmanager
def policy_autocast(policy: OpPolicy, device_type: str, dtype: torch.dtype) -> Any:
    """``torch.autocast(device_type, dtype)`` with ``policy.fp32_ops`` held in fp32."""
    with torch.autocast(device_type=device_type, dtype=dtype), Fp32Regions(policy.fp32_ops, device_type):
        yield


def kind_of(func: Any) -> str | None:
    """The op kind a torch function belongs to (None if no policy names it)."""
    return _KIND_OF.get(func)
