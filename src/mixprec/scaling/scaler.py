"""Dynamic loss scaling that works on every device: a drop-in for ``torch.amp.GradScaler``.

What it adds to torch's scaler (whose kernels it uses for the work itself):

- no device argument needed: the scale lives on the device of the first loss it scales
  (``torch.amp.GradScaler()`` defaults to CUDA and disables itself on a CPU-only machine); an explicit
  ``GradScaler("cuda")`` without CUDA warns and does nothing, as torch's does;
- hysteresis: tolerate ``hysteresis`` overflowing steps before backing off (as DeepSpeed and Megatron);
- bounds: the scale stays within ``[min_scale, max_scale]`` (torch's reaches 0.0 after enough non-finite
  steps and training silently stops), and ``max_consecutive_skips`` skipped steps in a row raise
  :class:`ConsecutiveSkipsError` naming the parameters whose gradients were non-finite;
- a public :class:`~mixprec.scaling.record.ScaleRecord` of every step, right for fused optimizers too;
- calls out of order raise an error that names the call.

Host syncs: ``step()`` syncs once to read the inf check (as torch's does) unless the optimizer is fused, in
which case ``update()`` syncs once instead. Nothing else on the step path syncs; ``get_scale()`` reads a
host mirror of the scale.
"""

from __future__ import annotations

import functools
import inspect
import math
import struct
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec import tree as pytree
from mixprec.scaling.optimizer_steps import (
    OptimizerState,
    Stage,
    fused_step,
    nonfinite_grad_names,
    self_scaling_step,
    unscale_grads,
)
from mixprec.scaling.record import ScaleRecord

# 2^24: a larger scale only matters for gradients below fp16's smallest subnormal times 2^-24, and it brings
# fp32 overflow of the scaled loss closer.
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24


def _fp32(x: float) -> float:
    """Round to fp32 as the device-side scale tensor does, so the host mirror matches it exactly (values
    beyond fp32's range become inf, as a cast does, where some Python versions' struct raises instead)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


class GradScaler:
    """Loss scaler with torch's interface and defaults (init 2^16, x2 every 2000 clean steps, x0.5 on overflow).

    Args:
        device: where the scale lives. Optional: by default the device of the first scaled loss.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as ``torch.amp.GradScaler``.
        hysteresis: the scale backs off on the ``hysteresis``-th overflowing step; the ones before it are
            skipped with the scale held (1 = torch's behaviour: every overflow backs off). As in Megatron-LM
            and DeepSpeed, the count is restored only when the scale grows: once it is spent, every
            overflow backs off, so a persistent overflow still drives the scale down quickly.
        min_scale, max_scale: bounds the scale never leaves. When not given: ``DEFAULT_MIN_SCALE`` (1) and
            ``DEFAULT_MAX_SCALE`` (2^24), widened to take in ``init_scale`` (torch accepts any positive one,
            ``1e38`` in its own tests). Bounds given explicitly must contain ``init_scale``.
        max_consecutive_skips: raise :class:`ConsecutiveSkipsError` after this many skipped steps in a row
            (``None`` never raises).
        history_size: how many recent steps :attr:`record` keeps.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        max_consecutive_skips: int | None = 100,
        history_size: int = 1000,
    ) -> None:
        if isinstance(device, (int, float)) and not isinstance(device, bool):
            raise TypeError(f"GradScaler's first argument is the device, got {device!r}; pass init_scale={device!r}")
        _check(init_scale > 0, "init_scale", init_scale, "must be > 0")
        self._bounds_given = min_scale is not None or max_scale is not None  # else a scale set is taken in
        if min_scale is None:
            min_scale = min(DEFAULT_MIN_SCALE, float(init_scale))
        if max_scale is None:
            max_scale = max(DEFAULT_MAX_SCALE, float(init_scale))
        _check(growth_factor > 1.0, "growth_factor", growth_factor, "must be > 1.0")
        _check(0.0 < backoff_factor < 1.0, "backoff_factor", backoff_factor, "must be in (0, 1)")
        _check(int(growth_interval) == growth_interval >= 1, "growth_interval", growth_interval, "must be >= 1")
        _check(int(hysteresis) == hysteresis >= 1, "hysteresis", hysteresis, "must be an integer >= 1")
        _check(0.0 < min_scale <= max_scale, "min_scale", min_scale, f"must be in (0, max_scale={max_scale}]")
        _check(
            min_scale <= init_scale <= max_scale,
            "init_scale",
            init_scale,
            f"must lie within [min_scale={min_scale}, max_scale={max_scale}]",
        )
        _check(
            max_consecutive_skips is None or max_consecutive_skips >= 1,
            "max_consecutive_skips",
            max_consecutive_skips,
            "must be >= 1 or None",
        )
        self._device = torch.device(device) if device is not None else None
        self._enabled = bool(enabled)
        if self._enabled and self._device is not None and self._device.type == "cuda" and not torch.cuda.is_available():
            # as torch's: scripts written for a GPU still run here (no fp16 CUDA autocast: nothing to scale)
            warnings.warn(
                "GradScaler(device='cuda') is enabled, but CUDA is not available: disabling loss scaling. "
                "Omit device= and the scaler takes its device from the loss.",
                stacklevel=2,
            )
            self._enabled = False
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.max_consecutive_skips = max_consecutive_skips
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        # host mirrors of the device state, following the kernel's arithmetic exactly: reading them never syncs
        self._scale_host = _fp32(self._init_scale)
        self._clean_streak = 0
        self._hysteresis_left = self.hysteresis
        self._states: dict[int, OptimizerState] = {}
        self._scaled_since_update = False
        self._found_inf_reducer: Callable[[torch.Tensor], None] | None = None
        self._param_names: dict[int, str] = {}
        self.record = ScaleRecord(history_size=history_size, scale=self.get_scale())

    # -- configuration -------------------------------------------------------------------------------

    def is_enabled(self) -> bool:
        return self._enabled

    def set_found_inf_reducer(self, reducer: Callable[[torch.Tensor], None] | None) -> None:
        """Install an in-place reduction (e.g. an all-reduce MAX) applied to each inf check, so every
        process makes the same skip decision when gradients are sharded (FSDP)."""
        self._found_inf_reducer = reducer

    def register_param_names(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Tell the scaler parameter names, so errors and logs can say which gradients were non-finite."""
        self._param_names.update({id(p): name for name, p in named_parameters})

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled). No host sync."""
        return self._scale_host if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    # -- the step ------------------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or nested tensors) by the scale. No host sync."""
        if not self._enabled:
            return outputs
        if _is_plain_iterable(outputs):  # a generator or other iterable: torch returns a lazy map over it
            return map(self.scale, outputs)
        leaves = pytree.tree_leaves(outputs)
        bad = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        if not leaves or bad:
            found = type(bad[0]).__name__ if bad else type(outputs).__name__
            raise TypeError(f"scale() takes a tensor or a (nested) container of tensors, got {found}")
        self._lazy_init(leaves[0].device)
        self._scaled_since_update = True
        return pytree.tree_map(lambda t: t * self._scale.to(device=t.device, non_blocking=True), outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and check them for inf/NaN (no host sync).

        Call it at most once per step, before clipping; ``step()`` calls it when you have not.
        """
        if not self._enabled:
            return
        self._require_scaled("unscale_")
        state = self._state(optimizer)
        if state.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "call it once per step, before clipping"
            )
        if state.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() was called after step(); call it before step()")
        # fp64 reciprocal: an fp32 division is inexact under some compile options (as torch does).
        inv_scale = self._scale.double().reciprocal().float()
        state.found_inf = self._unscale_grads(optimizer, inv_scale, allow_fp16=False)
        state.stage = Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then ``optimizer.step()`` unless a gradient is inf/NaN.

        Syncs once to read the inf check, except for fused optimizers (``fused=True``), which take the
        scale and the check as tensors and skip on the device; ``update()`` syncs for those instead.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("step(closure=...) is not supported while loss scaling is enabled")
        self._require_scaled("step")
        state = self._state(optimizer)
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update()")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                return self_scaling_step(optimizer, state, self, *args, **kwargs)
            check = functools.partial(self._unscale_grads, optimizer, allow_fp16=True)
            return fused_step(optimizer, state, self._scale, check, *args, **kwargs)
        if state.stage is Stage.READY:
            self.unscale_(optimizer)
        state.found_inf_host = bool(state.found_inf.item())  # the one host sync of the step
        state.stage = Stage.STEPPED
        return None if state.found_inf_host else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off on overflow (after ``hysteresis`` of them), grow after ``growth_interval`` clean steps,
        keep the scale within its bounds, and record the step; ``new_scale`` sets the scale instead, exactly,
        as torch's does (the bounds widen to take it in). Syncs once only after a fused step."""
        if not self._enabled:
            self.record.add(1.0, False, 1.0)
            return
        stepped = [s for s in self._states.values() if s.stage is Stage.STEPPED]
        if not stepped and new_scale is None:
            raise RuntimeError(
                "update() was called without scaler.step(optimizer) since the last update(); "
                "call scaler.step(optimizer) first"
            )
        # Every inf check since the last update moves the scale, an optimizer's unscaled and not stepped too, as
        # in torch. An optimizer handed `grad_scaler=` checks its own gradients and records a check only if it
        # called scaler.unscale_(self).
        checked = [s for s in self._states.values() if s.found_inf is not None]
        if not checked and new_scale is None:
            raise RuntimeError(
                "update() found no inf/NaN check for this step: an optimizer that takes grad_scaler= must call "
                "grad_scaler.unscale_(self) in its step(), or pass a new scale to update(new_scale)"
            )
        found_inf = sum((s.found_inf for s in checked[1:]), checked[0].found_inf) if checked else None
        known = [s.found_inf_host for s in checked]
        skipped = any(known) if None not in known else bool(found_inf.item())
        scale_used = self._scale_host
        if new_scale is None:
            self._advance(found_inf, skipped)
        else:
            self._set_scale(new_scale)
        if stepped:
            self.record.add(scale_used, skipped, self._scale_host)
        optimizers = [s.optimizer for s in stepped]
        self._states = {}
        self._scaled_since_update = False
        self.record.raise_if_too_many_skips(
            skipped,
            self.max_consecutive_skips,
            lambda: [n for opt in optimizers for n in self.nonfinite_grad_names(opt)],
            f"loss scale {self._scale_host:g}, floor {self.min_scale:g}",
            "The forward pass likely overflows: check the inputs and learning rate, try precision='bf16', or "
            "run `mixprec diagnose`.",
        )

    def nonfinite_grad_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of ``optimizer``'s parameters whose gradient holds inf/NaN. One host sync: for the rare
        path (a skipped step), not for every step."""
        return nonfinite_grad_names(optimizer, self._param_names)

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's keys (so torch's scaler can load it) plus the bounds, hysteresis and the record.
        ``{}`` when disabled, as torch's (so ``if scaler.state_dict():`` checks behave the same)."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale_host,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._clean_streak,
            "hysteresis": self.hysteresis,
            "_hysteresis_left": self._hysteresis_left,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "record": self.record.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict or one from ``torch.amp.GradScaler`` (missing keys keep their values).
        A disabled scaler ignores it, as torch's does."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the scaler state dict is empty: it was saved by a disabled torch GradScaler")
        self._scale_host = _fp32(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._clean_streak = int(state_dict["_growth_tracker"])
        self.hysteresis = int(state_dict.get("hysteresis", self.hysteresis))
        self._hysteresis_left = int(state_dict.get("_hysteresis_left", self.hysteresis))
        self.min_scale = float(state_dict.get("min_scale", self.min_scale))
        self.max_scale = float(state_dict.get("max_scale", self.max_scale))
        if "record" in state_dict:
            self.record.load_state_dict(state_dict["record"])
        if "max_scale" not in state_dict and self._scale_host > 0:  # torch's
            self._take_in(self._scale_host)
        # The bounds hold for loaded scales too: torch's scaler can have decayed to 0.0
        self._scale_host = _fp32(min(max(self._scale_host, self.min_scale), self.max_scale))
        self.record.scale = self.get_scale()
        if self._scale is not None:
            self._scale.fill_(self._scale_host)
            self._growth_tracker.fill_(self._clean_streak)

    # -- internals -----------------------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        if self._scale is not None:
            return
        if self._device is not None and self._device.type != device.type:
            raise RuntimeError(
                f"GradScaler(device={str(self._device)!r}) was asked to scale a loss on {device}; "
                "omit device= and the scaler takes it from the loss"
            )
        self._scale = torch.full((), self._scale_host, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._clean_streak, dtype=torch.int32, device=device)

    def _require_scaled(self, call: str) -> None:
        if self._scale is None or not self._scaled_since_update:
            raise RuntimeError(
                f"{call}() was called before scale() in this step: call scaler.scale(loss).backward() "
                f"first, so the gradients {call}() divides by the scale were multiplied by it"
            )

    def _state(self, optimizer: torch.optim.Optimizer) -> OptimizerState:
        return self._states.setdefault(id(optimizer), OptimizerState(optimizer))

    def _unscale_grads(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, allow_fp16: bool
    ) -> torch.Tensor:
        return unscale_grads(
            optimizer,
            inv_scale,
            allow_fp16=allow_fp16,
            home=self._scale.device,
            param_names=self._param_names,
            reducer=self._found_inf_reducer,
        )

    def _advance(self, found_inf: torch.Tensor, skipped: bool) -> None:
        """Move the scale one step: torch's update kernel on the device, the same arithmetic on the host."""
        if skipped:
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)
            self._clean_streak = 0
            if self._hysteresis_left > 0:  # tolerated overflow: the step is skipped, the scale holds
                self._growth_tracker.zero_()
                return
            self._scale_host = _fp32(self._scale_host * self._backoff_factor)
        else:
            self._clean_streak += 1
            if self._clean_streak == self._growth_interval:
                self._clean_streak = 0
                self._hysteresis_left = self.hysteresis
                grown = _fp32(self._scale_host * self._growth_factor)
                if math.isfinite(grown):  # the kernel keeps the old scale rather than store an inf
                    self._scale_host = grown
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
        )
        clamped = min(max(self._scale_host, self.min_scale), self.max_scale)
        if clamped != self._scale_host:
            self._scale_host = _fp32(clamped)
            self._scale.clamp_(self.min_scale, self.max_scale)

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
        _check(value > 0, "new_scale", value, "must be > 0")
        self._take_in(value)
        self._scale_host = _fp32(min(max(value, self.min_scale), self.max_scale))
        self.record.scale = self._scale_host
        if self._scale is not None:
            self._scale.fill_(self._scale_host)

    def _take_in(self, value: float) -> None:
        """A scale set by hand (``update(new_scale)``, a torch state) widens the default bounds, as ``init_scale``
        does; bounds given explicitly hold it."""
        if not self._bounds_given:
            self.min_scale, self.max_scale = min(self.min_scale, value), max(self.max_scale, value)

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop ``optimizer``'s unscale and inf check of this step: its gradients were zeroed without a step
        (the Accelerator's ``zero_grad``), so its next step unscales and checks afresh."""
        self._states.pop(id(optimizer), None)


LossScaler = GradScaler


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"GradScaler({name}={value!r}): {name} {rule}")


def _is_plain_iterable(obj: Any) -> bool:
    """An iterable that is neither a tensor nor a container the tree-map knows (a generator, a map, ...)."""
    if isinstance(obj, (torch.Tensor, str, bytes)) or not isinstance(obj, Iterable):
        return False
    return not pytree.is_container(obj)
