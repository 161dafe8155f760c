"""fp8 training of the Linear layers (torchao.float8), bf16 autocast for the rest.

Each convertible ``nn.Linear`` becomes torchao's ``Float8Linear``: its input, weight and output gradient
are cast to fp8 (e4m3 forward, e5m2 for gradients) with dynamic scales, and its three matmuls run on the
GPU's fp8 tensor cores. Everything else runs under bf16 autocast, parameters stay fp32 (master weights) and
no loss scaling is needed: the per-tensor scales do for fp8 what the loss scale does for fp16.

Scaling: "fp8" scales per tensor (torchao's default recipe, the fastest); "fp8-rowwise" scales per row
(more accurate with outliers; power-of-2 scales), as torchtitan offers both.

Layers fp8 cannot take, or would slow down, stay in bf16 and :meth:`Fp8Precision.describe` lists them with the
reason (fp8_layers.py: misaligned shapes, the output head, layers too small to pay; ``precision.layer_filter``
chooses). Under the test-only emulation small layers are converted too: it checks numerics, not speed.

Speed: the casts to fp8 are separate kernels unless ``torch.compile`` fuses them into their neighbours, so
compile the model (``TrainingArguments(torch_compile=True)``, ``mixprec train --compile``); torchao and
torchtitan report ~1.25x over bf16 on large models that way, and eager fp8 is often slower than bf16.

Devices: fp8 matmuls exist on CUDA compute capability 8.9+ (Ada, Hopper, Blackwell). Elsewhere the mode is
refused with what to use instead. ``MIXPREC_FP8_EMULATE=1`` (tests only) runs torchao's emulation, which does
the same casts and scales and multiplies the fp8-rounded values in fp32, so fp8's numerics can be tested on a
CPU; it is slower than bf16, never a fallback, and the strategy's reason says "emulated".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch

from mixprec.precision.base import PrecisionNotSupportedError
from mixprec.precision.fp8_layers import Fp8LayerFilter, embedding_weight_ids
from mixprec.precision.mixed import Bf16MixedPrecision
from mixprec.precision.torchao_extra import import_torchao, require_torchao_for_precision

EMULATE_ENV = "MIXPREC_FP8_EMULATE"
_MIN_CAPABILITY = (8, 9)


def fp8_emulation_requested() -> bool:
    """The one reader of ``MIXPREC_FP8_EMULATE``: a test-only switch for torchao's fp8 emulation."""
    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Fp8Precision(Bf16MixedPrecision):
    """fp8 Linear layers (tensorwise scaling) under bf16 autocast; fp32 master weights, no loss scaling."""

    name = "fp8"
    recipe: ClassVar[str] = "tensorwise"
    hf_flags = (False, False)  # HF's bf16 flag means bf16 autocast alone; its fp8 is another setting
    auto_candidate = False
    safety_rank = 3

    def __init__(self, device: torch.device | str | None = None, reason: str = "") -> None:
        super().__init__(device, reason)
        self.emulated = fp8_emulation_requested()
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}  # layer name -> why it stays in bf16
        # which layers convert_module converts; set another before it to choose otherwise
        self.layer_filter = Fp8LayerFilter(recipe=self.recipe, skip_small=not self.emulated)

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        super().check_supported(device)
        if not fp8_emulation_requested():
            if device.type != "cuda":
                raise PrecisionNotSupportedError(
                    f"precision {cls.name!r}: {device.type} has no fp8 matmuls (they need a CUDA GPU of compute "
                    "capability 8.9+: Ada, Hopper, Blackwell); use precision='bf16'"
                )
            capability = torch.cuda.get_device_capability(device)
            if capability < _MIN_CAPABILITY:
                gpu = torch.cuda.get_device_name(device)
                raise PrecisionNotSupportedError(
                    f"precision {cls.name!r}: the GPU {gpu!r} (compute capability {capability[0]}.{capability[1]}) "
                    "has no fp8 matmuls, which need 8.9+ (Ada, Hopper, Blackwell); use precision='bf16'"
                )
        require_torchao_for_precision(cls.name)

    def float8_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for this recipe (with emulation when the test switch is on)."""
        config_mod = import_torchao(f"precision={self.name!r}", "torchao.float8")
        config = config_mod.Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(config, emulate=self.emulated) if self.emulated else config

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Swap each convertible ``nn.Linear`` for torchao's ``Float8Linear``, in place: the module object and
        its Parameter objects stay the same (optimizers built earlier still hold them; the state_dict keys do
        not change). Calling it again converts nothing twice."""
        float8 = import_torchao(f"precision={self.name!r}", "torchao.float8")
        from torchao.float8.float8_linear import Float8Linear  # a submodule of the one just imported

        self.converted, self.skipped = [], {}
        embeddings = embedding_weight_ids(module)
        for fqn, layer in module.named_modules():
            if isinstance(layer, Float8Linear):
                self.converted.append(fqn)
            elif isinstance(layer, torch.nn.Linear):
                why = self.layer_filter.why_not(fqn, layer, embeddings)
                if why:
                    self.skipped[fqn or "<root>"] = why

        def wanted(layer: torch.nn.Module, fqn: str) -> bool:
            if isinstance(layer, Float8Linear) or self.layer_filter.why_not(fqn, layer, embeddings):
                return False
            self.converted.append(fqn)
            return True

        return float8.convert_to_float8_training(module, module_filter_fn=wanted, config=self.float8_config())

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["fp8_recipe"] = self.recipe
        out["fp8_emulated"] = self.emulated
        out["fp8_layers"] = list(self.converted)
        out["bf16_layers"] = dict(self.skipped)
        out["reason"] = self._full_reason()
        return out

    def _full_reason(self) -> str:
        # The run summary prints only the reason: it carries what fp8 covered, so a model whose head (or
        # every layer) stayed in bf16 does not pass for an fp8 run.
        parts = [self.reason, f"{self.recipe} scaling"]
        if self.emulated:
            parts.append(f"emulated ({EMULATE_ENV}=1, for tests: fp8 rounding, fp32 matmuls, slower than bf16)")
        if self.converted or self.skipped:
            total = len(self.converted) + len(self.skipped)
            note = f"{len(self.converted)} of {total} Linear layers in fp8"
            if self.skipped:
                shown = [f"{name} ({why})" for name, why in list(self.skipped.items())[:3]]
                more = len(self.skipped) - len(shown)
                note += "; in bf16: " + ", ".join(shown) + (f" and {more} more" if more else "")
            parts.append(note)
        return "; ".join(parts)


class Fp8RowwisePrecision(Fp8Precision):
    """fp8 with one scale per row (torchao's "rowwise" recipe): more accurate with outliers, a bit slower."""

    name = "fp8-rowwise"
    recipe = "rowwise"
