"""accelerate's own objects handed to mixprec's Accelerator, and accelerate's process state kept in step with it.

A script moved to mixprec by its import line still builds accelerate's helpers (issue 22): its
``ProjectConfiguration``, ``GradientAccumulationPlugin``, ``DataLoaderConfiguration`` and ``kwargs_handlers=[...]``
reach our constructor, and ``accelerate.logging.get_logger``, ``PartialState()`` and ``accelerate.utils`` read
accelerate's process-wide state. This module is the one place that translates between the two:

- :func:`adopt` turns accelerate's configuration dataclasses into mixprec's of the same name (the fields mixprec
  has are copied; one it lacks, set away from accelerate's default, is refused by name). A copy: the Accelerator
  updates its own (``accelerator.project_configuration.iteration``), not the object the script passed;
- :func:`read_handlers` turns accelerate's kwargs handlers into the constructor arguments they mean (a registry
  by class name, so accelerate is never imported to recognise them), or refuses one with the fix;
- :class:`SharedState` sets up accelerate's ``PartialState`` and ``GradientState`` from the Accelerator's, when
  accelerate is installed (it is imported then, and only then); :func:`autocast_for` reads ``AutocastKwargs``;
- :func:`profile`: ``accelerator.profile()``. accelerate's ``ProfileKwargs`` builds its own
  ``torch.profiler.profile`` (``build()``), so mixprec keeps the handler and lets it build, rather than
  re-reading each of its fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch

from mixprec.accelerator.gradients import GradientAccumulationPlugin

logger = logging.getLogger("mixprec.accelerator")

T = TypeVar("T")


def from_accelerate(obj: object) -> bool:
    """Whether ``obj`` is an instance of a class defined in the accelerate package."""
    return type(obj).__module__.partition(".")[0] == "accelerate"


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def adopt(obj: Any, ours: type[T], arg: str) -> T | None:
    """``obj`` as mixprec's ``ours``: None and ours pass through; accelerate's class of the same name is copied
    field by field (a field mixprec lacks, set away from its default, is refused by name); anything else is a
    TypeError naming ``arg``."""
    if obj is None or isinstance(obj, ours):
        return obj
    name = ours.__name__
    if not (from_accelerate(obj) and type(obj).__name__ == name and dataclasses.is_dataclass(obj)):
        raise TypeError(
            f"Accelerator({arg}=...): expected a {name}, got {type(obj).__name__}; pass mixprec's or accelerate's"
        )
    mine = {f.name for f in dataclasses.fields(ours) if f.init}  # type: ignore[arg-type]
    values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in mine:
            if value is not None or _default(f) is not None:  # accelerate's None: "unset", ours has a default
                values[f.name] = value
        elif value != _default(f):
            raise ValueError(
                f"Accelerator({arg}={name}({f.name}={value!r})): {f.name} is not supported by mixprec; leave it at "
                f"{_default(f)!r}"
            )
    return ours(**values)


# -- kwargs handlers ---------------------------------------------------------------------------------


@dataclasses.dataclass
class HandlerSettings:
    """The constructor arguments accelerate's kwargs handlers stand for (what the caller passed directly
    included, so a handler and an argument saying different things are refused)."""

    scaler_kwargs: dict[str, Any]
    ddp_kwargs: dict[str, Any]
    timeout: float | None
    comm_dtype: str | None
    profile: Any = None
    """accelerate's ProfileKwargs, for ``accelerator.profile()``."""

    def merge(self, field: str, values: Mapping[str, Any], handler: str) -> None:
        target = getattr(self, field)
        for key, value in values.items():
            if key in target and target[key] != value:
                raise ValueError(
                    f"Accelerator({field}={{{key!r}: {target[key]!r}}}, kwargs_handlers=[{handler}({key}={value!r})]):"
                    f" two values for {key}; pass it once"
                )
            target[key] = value

    def set(self, field: str, value: Any, handler: str) -> None:
        if getattr(self, field) not in (None, value):
            raise ValueError(
                f"Accelerator({field}={getattr(self, field)!r}, kwargs_handlers=[{handler}(...)]): two values for "
                f"{field}; pass it once"
            )
        setattr(self, field, value)


def _non_default(handler: Any) -> dict[str, Any]:
    """The fields set away from a fresh handler's (accelerate's ``KwargsHandler.to_kwargs``). Compared with a
    fresh instance, not the field defaults: some handlers fill fields in ``__post_init__`` (``AORecipeKwargs``
    its torchao config, ``InitProcessGroupKwargs`` its timeout)."""
    fresh = type(handler)()
    return {
        f.name: getattr(handler, f.name)
        for f in dataclasses.fields(handler)
        if getattr(handler, f.name) != getattr(fresh, f.name)
    }


def _refuse(handler: Any, fix: str) -> None:
    fields = ", ".join(f"{k}={v!r}" for k, v in _non_default(handler).items())
    raise ValueError(f"Accelerator(kwargs_handlers=[{type(handler).__name__}({fields})]): {fix}")


def _grad_scaler(handler: Any, out: HandlerSettings) -> None:
    # Same names and meaning as torch's GradScaler, which mixprec's takes: init_scale, growth_factor,
    # backoff_factor, growth_interval, enabled.
    out.merge("scaler_kwargs", _non_default(handler), "GradScalerKwargs")


# accelerate's DDPCommunicationHookType values -> mixprec's comm_dtype names.
_COMM_HOOKS = {"no": None, "fp16": "fp16", "bf16": "bf16", "power_sgd": "powersgd"}


def _ddp(handler: Any, out: HandlerSettings) -> None:
    values = _non_default(handler)
    hook = values.pop("comm_hook", None)
    if "comm_wrapper" in values or "comm_state_option" in values:
        _refuse(handler, "comm_wrapper / comm_state_option are not supported; use comm_hook alone (or comm_dtype=)")
    if hook is not None:
        kind = getattr(hook, "value", hook)
        if kind not in _COMM_HOOKS:
            _refuse(handler, f"comm_hook={kind!r} is not supported; choose one of {sorted(_COMM_HOOKS)}")
        out.set("comm_dtype", _COMM_HOOKS[kind], "DistributedDataParallelKwargs")
    out.merge("ddp_kwargs", values, "DistributedDataParallelKwargs")


def _init_process_group(handler: Any, out: HandlerSettings) -> None:
    values = _non_default(handler)
    timeout = values.pop("timeout", None)
    if values:
        _refuse(
            handler,
            "mixprec picks the backend (nccl on CUDA, gloo on CPU) and reads the rendezvous from torchrun's "
            "environment; keep only timeout=",
        )
    if timeout is not None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        out.set("timeout", seconds, "InitProcessGroupKwargs")


def _autocast(handler: Any, out: HandlerSettings) -> None:
    if _non_default(handler):
        _refuse(
            handler,
            "a whole run without autocast is mixed_precision='no'; for one block use "
            "`with accelerator.autocast(autocast_handler=AutocastKwargs(...))`",
        )


def _ao_recipe(handler: Any, out: HandlerSettings) -> None:
    # The default is accepted: torchao's tensorwise recipe, which mixed_precision="fp8" runs (a Linear whose
    # dimensions do not divide by 16 stays bf16 there, where accelerate pads it).
    if _non_default(handler):
        _refuse(handler, "mixprec's torchao fp8 recipes are mixed_precision='fp8' (tensorwise) or 'fp8-rowwise'")


def _fp8_recipe(handler: Any, out: HandlerSettings) -> None:
    if str(getattr(handler, "backend", "")).upper() not in ("AO", "TORCHAO"):
        _other_fp8(handler, out)
    _ao_recipe(handler, out)


def _other_fp8(handler: Any, out: HandlerSettings) -> None:
    _refuse(handler, "mixprec's fp8 runs on torchao only: pass mixed_precision='fp8' and drop the handler")


def _profile(handler: Any, out: HandlerSettings) -> None:
    # kept whole: ProfileKwargs builds its own torch.profiler.profile (see profile() below)
    out.profile = handler


HANDLERS: dict[str, Callable[[Any, HandlerSettings], None]] = {
    "GradScalerKwargs": _grad_scaler,
    "DistributedDataParallelKwargs": _ddp,
    "InitProcessGroupKwargs": _init_process_group,
    "AutocastKwargs": _autocast,
    "AORecipeKwargs": _ao_recipe,
    "FP8RecipeKwargs": _fp8_recipe,
    "TERecipeKwargs": _other_fp8,
    "MSAMPRecipeKwargs": _other_fp8,
    "ProfileKwargs": _profile,
}
"""accelerate's kwargs handler class name -> what it does to the constructor's arguments."""


def accumulation_plugin(plugin: Any, steps: int) -> GradientAccumulationPlugin | None:
    """``Accelerator(gradient_accumulation_plugin=...)`` as mixprec's plugin (accelerate's taken field by field);
    refused beside ``gradient_accumulation_steps`` other than 1, which it would contradict."""
    plugin = adopt(plugin, GradientAccumulationPlugin, "gradient_accumulation_plugin")
    if plugin is not None and steps != 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps!r}, gradient_accumulation_plugin=...): pass only one "
            "of gradient_accumulation_steps and gradient_accumulation_plugin (set num_steps in the plugin)"
        )
    return plugin


def read_handlers(
    handlers: Iterable[Any] | None,
    *,
    scaler_kwargs: Mapping[str, Any] | None,
    ddp_kwargs: Mapping[str, Any] | None,
    timeout: float | None,
    comm_dtype: str | None,
) -> HandlerSettings:
    """The constructor arguments once accelerate's ``kwargs_handlers`` are applied (each at most once)."""
    out = HandlerSettings(dict(scaler_kwargs or {}), dict(ddp_kwargs or {}), timeout, comm_dtype)
    seen: set[str] = set()
    for handler in handlers or ():
        kind = type(handler).__name__
        apply = HANDLERS.get(kind) if from_accelerate(handler) and dataclasses.is_dataclass(handler) else None
        if apply is None:
            raise TypeError(
                f"Accelerator(kwargs_handlers=[{kind}(...)]): not one of accelerate's handlers mixprec reads "
                f"({', '.join(HANDLERS)})"
            )
        if kind in seen:
            raise ValueError(f"Accelerator(kwargs_handlers=[...]): {kind} given twice; pass one")
        seen.add(kind)
        apply(handler, out)
    return out


def autocast_for(handler: Any, precision: Any) -> contextlib.AbstractContextManager[Any]:
    """``accelerator.autocast(autocast_handler=AutocastKwargs(...))``: autocast off for the block
    (``enabled=False``), or the precision's autocast with accelerate's ``cache_enabled``."""
    if handler is None:
        return precision.autocast()
    if not (from_accelerate(handler) and type(handler).__name__ == "AutocastKwargs"):
        raise TypeError(
            f"autocast(autocast_handler=...): expected accelerate's AutocastKwargs, got {type(handler).__name__}"
        )
    device = precision.device.type
    if not handler.enabled:
        return torch.autocast(device_type=device, enabled=False)
    if handler.cache_enabled is None or precision.compute_dtype == torch.float32:
        return precision.autocast()
    return torch.autocast(device_type=device, dtype=precision.compute_dtype, cache_enabled=handler.cache_enabled)


# -- accelerate's process state --------------------------------------------------------------------


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: blocked (sys.modules[name] = None), as a missing package
        return False


class SharedState:
    """accelerate's process-wide state, set up from one Accelerator's (a null object without accelerate).

    ``accelerate.logging``, ``PartialState()`` and ``accelerate.utils`` read accelerate's singletons; a script
    that swapped only the Accelerator would find them empty. ``PartialState`` is made after mixprec has joined
    the process group, so accelerate reads that group (rank, world size, device) rather than starting its own;
    one the script made first is left as it is. ``GradientState`` mirrors the accumulation settings.

    accelerate's ``AcceleratorState`` (its precision) is left to accelerate's own Accelerator: accelerate lets a
    process fix it once, so filling it here would make an ``accelerate.Accelerator`` (HF's Trainer) created
    later in the same process fail on any other precision. ``AcceleratorState()`` therefore still raises
    accelerate's "initialize your accelerator" error; ``accelerator.state`` is mixprec's equivalent.
    """

    def __init__(self, gradients: Any = None) -> None:
        self._gradients = gradients  # accelerate's GradientState, or None

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled Accelerator (accelerate's scripts pickle theirs) carries no process-wide state: accelerate's
        # GradientState holds weak references to its own loaders. Unpickled, it mirrors into this process's
        # GradientState if accelerate has one, else it is the null object.
        return (_reattach, ())

    @classmethod
    def start(cls, *, device: torch.device, accumulation: Mapping[str, Any], timeout: float | None) -> SharedState:
        if not _installed("accelerate"):
            return cls()
        from accelerate.state import GradientState, PartialState
        from accelerate.utils import GradientAccumulationPlugin

        if not PartialState._shared_state:
            kwargs: dict[str, Any] = {"cpu": device.type == "cpu"}
            if timeout is not None:
                kwargs["timeout"] = timedelta(seconds=timeout)
            threads = torch.get_num_threads()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="OMP_NUM_THREADS/MKL_NUM_THREADS unset")
                PartialState(**kwargs)
            # accelerate lowers the thread count of several CPU processes when OMP_NUM_THREADS is unset; setting
            # up its state must not change how mixprec's process runs.
            torch.set_num_threads(threads)
        return cls(GradientState(GradientAccumulationPlugin(**accumulation)))

    def mirror(self, num_steps: int | None = None, sync_gradients: bool | None = None) -> None:
        """Copy what a script set on the Accelerator into accelerate's GradientState (no-op without it)."""
        if self._gradients is None:
            return
        if num_steps is not None:
            self._gradients.plugin_kwargs = {**self._gradients.plugin_kwargs, "num_steps": num_steps}
        if sync_gradients is not None:
            self._gradients.sync_gradients = sync_gradients


@contextlib.contextmanager
def profile(
    handler: Any, *, process_index: int, wait_for_everyone: Callable[[], None]
) -> Iterator[torch.profiler.profile]:
    """Profile the block; ``handler``: accelerate's ``ProfileKwargs`` (or anything with ``build()`` and
    ``output_trace_dir``), or None for torch.profiler's defaults (the CPU, and CUDA where present). With
    ``output_trace_dir``, each process writes a Chrome trace named as accelerate names it
    (``trace_<process index>.json``), then the processes meet. Costs what torch.profiler costs (host syncs on
    CUDA when the trace is collected)."""
    profiler = handler.build() if handler is not None else torch.profiler.profile()
    with profiler:
        yield profiler
    trace_dir = getattr(handler, "output_trace_dir", None)
    if trace_dir is None:
        return
    os.makedirs(trace_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(trace_dir, f"trace_{process_index}.json"))
    wait_for_everyone()


def _reattach() -> SharedState:
    if not _installed("accelerate"):
        return SharedState()
    from accelerate.state import GradientState

    return SharedState(GradientState() if GradientState._shared_state else None)
