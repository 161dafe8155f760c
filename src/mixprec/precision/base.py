"""The precision strategy: what one mode means on one device.

A ``Precision`` is a small object with a fixed set of hooks (after Lightning Fabric's precision plugins).
Each mode overrides only the hooks it needs; callers never branch on the mode's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from mixprec.scaling.scaler import GradScaler


class PrecisionNotSupportedError(ValueError):
    """A precision this device cannot run. Raised instead of silently running something else."""


class Precision:
    """Base strategy: full fp32 behaviour for every hook.

    Subclasses set the class attributes and override ``autocast`` / ``convert_module`` where the mode
    differs. ``check_supported`` is called at construction so an object that exists can run.
    """

    name: ClassVar[str] = ""
    compute_dtype: ClassVar[torch.dtype] = torch.float32
    param_dtype: ClassVar[torch.dtype] = torch.float32
    needs_loss_scaling: ClassVar[bool] = False

    def __init__(self, device: torch.device | str | None = None, reason: str = "") -> None:
        self.device = torch.device(device) if device is not None else _default_device()
        self.check_supported(self.device)
        self.reason = reason or f"{self.name} was asked for"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        """Raise :class:`PrecisionNotSupportedError` if this mode cannot run on ``device``. The base check,
        which every override calls first: the device exists on this machine."""
        # torch.device("cuda") constructs fine without CUDA; the failure would come later and elsewhere
        # (or, for "auto", as a wrong reason: "this GPU has no bf16").
        if device.type == "cuda" and not torch.cuda.is_available():
            raise PrecisionNotSupportedError(
                f"precision {cls.name or 'auto'!r} on device {str(device)!r}: CUDA is not available on this "
                "machine; use device='cpu' (or omit device= to get the default)"
            )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward pass runs under (a null context for full precision)."""
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Return ``module`` ready for this mode. Mixed modes keep fp32 master weights: identity."""
        return module

    def convert_output(self, data: Any) -> Any:
        """Cast low-precision floating tensors in a model's outputs back to fp32 (no host sync)."""
        return _to_fp32(data)

    def make_scaler(self, **scaler_kwargs: Any) -> GradScaler:
        """A loss scaler for this mode: active for fp16, a pass-through with the same interface otherwise."""
        from mixprec.scaling.scaler import GradScaler

        return GradScaler(enabled=self.needs_loss_scaling, device=self.device, **scaler_kwargs)

    def describe(self) -> dict[str, Any]:
        """What this mode means, for logs and summaries."""
        return {
            "precision": self.name,
            "device": str(self.device),
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "loss_scaling": self.needs_loss_scaling,
            "reason": self.reason,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r}, reason={self.reason!r})"


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _to_fp32(data: Any) -> Any:
    """Recursively cast fp16/bf16 tensors to fp32, keeping container types (dicts, HF ModelOutput,
    dataclasses, namedtuples). Integer tensors and fp32 tensors pass through untouched."""
    if isinstance(data, torch.Tensor):
        return data.float() if data.dtype in _LOW_PRECISION else data
    if isinstance(data, Mapping):
        if hasattr(data, "to_tuple"):  # HF ModelOutput: an OrderedDict + dataclass; set keys in place
            for key in list(data.keys()):
                data[key] = _to_fp32(data[key])
            return data
        return type(data)({k: _to_fp32(v) for k, v in data.items()})
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {f.name: _to_fp32(getattr(data, f.name)) for f in dataclasses.fields(data) if f.init}
        return dataclasses.replace(data, **changes)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_to_fp32(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_to_fp32(v) for v in data)
    return data
