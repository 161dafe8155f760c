"""The precision strategy: what one mode means on one device, and how it runs a training step.

A ``Precision`` is a small object with a fixed set of hooks (after Lightning Fabric's precision plugins).
Each mode overrides only the hooks it needs; callers (the Accelerator, the bench) never branch on the mode:

=====================  ===================================================================================
``convert_module``     the module ready for this mode (mixed modes keep fp32 master weights: identity)
``convert_optimizer``  the optimizer ready for this mode (fp32 masters for trainable fp16/bf16 parameters)
``autocast``           the context the forward pass runs under
``convert_output``     low-precision floating outputs back to fp32
``backward``           the backward pass (scaled for fp16)
``unscale``            true gradients in ``.grad`` before clipping (a no-op without scaling)
``optimizer_step``     the update, skipped when a gradient is non-finite, and the scale's update
``state_dict``         what a checkpoint must hold to continue exactly (the scaler and its record)
=====================  ===================================================================================

The strategy owns its loss scaler (``self.scaler``): a real one for fp16, torch's interface as a
pass-through otherwise, so one loop serves every mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from mixprec.precision.announcement import RunContext, announce
from mixprec.precision.compile_choice import CompileFigures
from mixprec.precision.formats import FloatFormat, format_of
from mixprec.precision.master_weights import gather_grads, master_names, refresh_params, with_master_weights
from mixprec.scaling.guard import NonFiniteGuard
from mixprec.scaling.scaler import GradScaler
from mixprec.tree import tree_map


class PrecisionNotSupportedError(ValueError):
    """A precision this device cannot run. Raised instead of silently running something else."""


class Precision:
    """Base strategy: full fp32 behaviour for every hook.

    Subclasses set the class attributes and override the hooks where the mode differs. ``check_supported``
    is called at construction so an object that exists can run.
    """

    name: ClassVar[str] = ""
    """The canonical name ("fp32", "fp16", "bf16:fp32_ops=attention"...; "auto" until it decides)."""
    compute_dtype: ClassVar[torch.dtype] = torch.float32
    """The dtype the forward's low-precision ops compute in (torch.float32 for full precision)."""
    param_dtype: ClassVar[torch.dtype] = torch.float32
    """The dtype the optimizer's weights are held in (bfloat16 for the pure bf16 modes)."""
    needs_loss_scaling: ClassVar[bool] = False
    """Whether the loss is scaled (fp16 and its policies): ask this, never compare the name."""
    auto_candidate: ClassVar[bool] = False
    """Whether precision="auto" may choose this mode by speed. Modes that trade accuracy or memory for speed
    beyond autocast's (pure bf16, fp8) are a user's decision, not a timing's."""
    safety_rank: ClassVar[int] = 0
    """Order of numerical safety among auto's candidates (0 safest): a faster mode must beat every safer one
    by the margin, so ties go to the safer mode."""
    hf_flags: ClassVar[tuple[bool, bool]] = (False, False)
    """HF's (fp16, bf16) TrainingArguments flags for this mode: the autocast mode it is (a policy: its base's)."""
    recompute_refusal: ClassVar[str] = ""
    """Why this mode cannot train a model that recomputes its activations in backward (activation, or gradient,
    checkpointing); "" where it can. Asked before training, so the refusal is one line naming the fix."""

    def __init__(self, device: torch.device | str | None = None, reason: str = "") -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.check_supported(self.device)
        self.reason = reason or f"{self.name} was asked for"
        self._scaler_kwargs: dict[str, Any] = {}
        self._found_inf_reducer: Callable[[torch.Tensor], None] | None = None
        self._scaler: GradScaler | None = None
        self._param_names: list[tuple[str, torch.nn.Parameter]] = []
        self._run_context: RunContext | None = None

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

    def bind(self, device: torch.device, processes: int = 1) -> None:
        """Take the device and process count of the code that runs this strategy (the Accelerator), for a
        strategy made before them: ``make_precision("bf16")`` on "cuda" runs on this process's "cuda:N".
        Raises ValueError, naming the fix, for another kind of device or once the scaler exists (a strategy
        already used elsewhere). ``processes`` matters to "auto" only (its race runs in lockstep)."""
        if device.type != self.device.type or (self.device.index is not None and device != self.device):
            raise ValueError(
                f"precision {self.name!r} was made for device {str(self.device)!r} but runs on {str(device)!r}; "
                f"make it with make_precision({self.name!r}, device={str(device)!r}), or pass its name"
            )
        if device != self.device and self._scaler is not None:
            raise ValueError(
                f"precision {self.name!r} already has a scaler on {str(self.device)!r}; pass a new strategy "
                f"(make_precision({self.name!r}, device={str(device)!r})) or its name"
            )
        self.device = device

    # -- configuration -------------------------------------------------------------------------------

    def configure(
        self,
        scaler_kwargs: Mapping[str, Any] | None = None,
        found_inf_reducer: Callable[[torch.Tensor], None] | None = None,
        agree: Callable[[list[str]], list[str]] | None = None,
        is_main: bool = True,
        run: RunContext | None = None,
    ) -> None:
        """Set the scaler's knobs and the cross-process inf-check reduction (before the first step), and what
        surrounds this precision in the run (``run``: the line ``announce()`` says). ``agree`` and
        ``is_main`` serve a mode still to be decided ("auto"); a named mode ignores them."""
        self._scaler_kwargs = dict(scaler_kwargs or {})
        self._found_inf_reducer = found_inf_reducer
        self._scaler = None
        self._run_context = run

    announcement_held = False
    """While True, :meth:`announce` says nothing: the Trainer holds "auto"'s line while it replays the race, so the
    line says the race's whole cost once (:meth:`release_announcement`)."""

    def announce(self) -> None:
        """Say what this run is, once, through the ``mixprec`` logger (precision/announcement.py): the
        configured run's owner calls it when the run is set up; "auto" calls it again once it has decided."""
        if self._run_context is not None and not self.announcement_held:
            announce(self.describe(), self.pending, self._run_context)

    def release_announcement(self) -> None:
        """Stop holding the run's line, and say it if it was decided while held."""
        if self.announcement_held:
            self.announcement_held = False
            if not self.pending:
                self.announce()

    @property
    def scaler(self) -> GradScaler:
        """This mode's loss scaler, made on first use from the configured knobs."""
        if self._scaler is None:
            self._scaler = self.make_scaler(**self._scaler_kwargs)
            self._scaler.set_found_inf_reducer(self._found_inf_reducer)
            self._scaler.register_param_names(self._param_names)
        return self._scaler

    def register_param_names(self, named_parameters: Any) -> None:
        """Parameter names, so a skipped step can say which gradients were non-finite."""
        named = list(named_parameters)
        self._param_names.extend(named)
        if self._scaler is not None:
            self._scaler.register_param_names(named)

    def forget_parameters(self) -> None:
        """Drop the registered parameters (``Accelerator.free_memory``; the scaler keeps only their names)."""
        self._param_names.clear()

    # -- facts: what callers ask instead of comparing the mode's name ----------------------------------

    @property
    def compute_format(self) -> FloatFormat:
        """The number format the forward's low-precision ops compute in, with its range (fp32 for full
        precision). A ValueError for a compute dtype no format describes: never another format's range."""
        return format_of(self.compute_dtype)

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype the model's matmuls (its linear layers) run in: the compute dtype, or fp32 where a policy
        keeps them there. What a FLOP/s peak is measured in."""
        return self.compute_dtype

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 weights (the model's own, or fp32 masters of fp16/bf16 ones)."""
        return self.param_dtype == torch.float32

    @property
    def update_rounding(self) -> str:
        """How the optimizer's update is written into the weights: "nearest" (fp32 weights, round to nearest
        in fp32), "stochastic" or "kahan" (the pure bf16 modes: what their optimizer actually does)."""
        return "nearest"

    @property
    def may_scale_loss(self) -> bool:
        """Whether this run scales the loss, or may: fp16 and its policies, and "auto" while a candidate does.
        What a caller that cannot work with a loss scale (the step in backward) asks."""
        return any(p.needs_loss_scaling for p in self.options())

    def leave_out(self, unfit: Callable[[Precision], bool], why: str) -> None:
        """A run that some modes cannot train (the step in backward: fp16): nothing for a named mode, which the
        caller refuses; "auto" races without its ``unfit`` candidates and says ``why`` in its decision."""

    def model_refusal(self, model: torch.nn.Module) -> str | None:
        """Why this mode may fail to compute ``model`` (None: it cannot be the cause): a parameter in the other
        16-bit dtype than its autocast's, which autocast mixes with its own (a layer norm fails on the two). Said
        when a forward fails in torch's words."""
        low = self.compute_dtype
        if self.param_dtype != torch.float32 or low not in (torch.float16, torch.bfloat16):
            return None  # fp32 computes what it is given; a pure mode casts the model itself
        other = torch.bfloat16 if low == torch.float16 else torch.float16
        name = next((n for n, p in model.named_parameters() if p.dtype == other), None)
        if name is None:
            return None
        fix, theirs, ours = ("bf16" if other == torch.bfloat16 else "fp16"), _short(other), _short(low)
        return (
            f"parameter {name!r} is {theirs} and precision {self.name!r} computes in {ours}, which autocast cannot "
            f"mix; cast the model to float32 (model.float()) or to {ours}, or use precision={fix!r}"
        )

    @property
    def in_trial(self) -> bool:
        """Whether the step now running is a race's trial ("auto"), whose gradients are read and put back: nothing
        may step the weights in its backward."""
        return False

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are held in, and travel in between processes unless ``comm_dtype`` compresses
        them: the parameters' dtype."""
        return self.param_dtype

    def narrowest_format(self) -> FloatFormat:
        """The narrowest format this run may compute in: its own; an undecided "auto"'s narrowest candidate's
        (what a watch or a diagnosis must judge it by until it decides)."""
        return min((p.compute_format for p in self.options()), key=lambda f: f.max)

    @property
    def decided(self) -> bool:
        """Whether these facts are the run's for good: one option left. "auto" answers each fact for its current
        mode (its safest candidate before the race, a trial's during it) and is decided once it has chosen."""
        return len(self.options()) == 1

    def autocast_kwargs(self) -> dict[str, Any]:
        """The arguments of ``torch.autocast`` this mode's forward runs under (``enabled=False`` without)."""
        low = self.compute_dtype != torch.float32
        return {"device_type": self.device.type, "dtype": self.compute_dtype, "enabled": low}

    # -- a mode decided on the training step ("auto"); a named one is decided from the start ----------

    @property
    def pending(self) -> bool:
        """Whether the mode is still to be measured (only "auto" before its first training step)."""
        return False

    @property
    def resolved(self) -> Precision:
        """The concrete strategy running the step (itself; "auto"'s choice once made)."""
        return self

    def options(self) -> list[Precision]:
        """The modes this strategy may still turn out to be (itself; "auto"'s candidates until it decides)."""
        return [self]

    def settle(self, loss_fn: Callable[[], torch.Tensor], models: Any, **facts: Any) -> Any:
        """Decide a pending mode on the training step: ``loss_fn`` runs that step's forward and returns its loss;
        ``facts`` about the run (its length, formats known unsafe) may inform the choice (see
        :class:`~mixprec.precision.auto.AutoPrecision`). A named mode has nothing to decide. Returns the
        decision, or None (none made, or one still being made on the steps that follow)."""
        return None

    def begin_step(self, loss_fn: Callable[[], torch.Tensor], models: Any, **facts: Any) -> None:
        """A training step begins (its first training forward; arguments as :meth:`settle`): a pending mode
        decides here, or runs the step in the mode its decision needs measured next. Nothing for a named mode."""

    def decision_record(self) -> dict[str, Any] | None:
        """What "auto" measured and chose, for a checkpoint; None for a mode asked for by name."""
        return None

    def note_compile(self, figures: CompileFigures) -> None:
        """What compiling measured on this run (``mixprec.trainer.compile_gate``): "auto" records it in its
        decision and cache; a named mode, compiled as asked, keeps no record (the run's summary reports it)."""

    def adopt_recorded(self, saved_name: str, record: Mapping[str, Any] | None) -> None:
        """At resume: a named mode keeps its name; a change from the checkpoint's precision is said aloud."""
        if saved_name != self.name:
            import logging

            logging.getLogger("mixprec.precision").warning(
                "the state was saved under %s and is now loaded into %s: the run continues, but not as it would "
                "have (resume with precision=%r for an exact continuation)",
                saved_name,
                self.name,
                saved_name,
            )

    def make_scaler(self, **scaler_kwargs: Any) -> GradScaler:
        """A new loss scaler for this mode: active for fp16; for every other mode a pass-through with the same
        interface that still skips a step whose gradients are non-finite (see
        :mod:`mixprec.scaling.guard`)."""
        if self.needs_loss_scaling:
            return GradScaler(device=self.device, **scaler_kwargs)
        return NonFiniteGuard(**scaler_kwargs)

    # -- the hooks -----------------------------------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Return ``module`` ready for this mode. Mixed modes keep fp32 master weights: identity."""
        return module

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer`` ready for this mode: the update is the optimizer's own, in fp32 (``param_dtype``).
        A trainable fp16/bf16 parameter gets an fp32 master that the optimizer steps in its place (see
        :mod:`mixprec.precision.master_weights`); frozen ones are left as they are. Identity when there is
        none."""
        names = {id(p): name for name, p in self._param_names}
        converted = with_master_weights(optimizer, lambda p: names.get(id(p), "<not in a prepared model>"))
        self.register_param_names(master_names(converted, list(self._param_names)))
        return converted

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward pass runs under (a null context for full precision)."""
        return contextlib.nullcontext()

    def convert_output(self, data: Any) -> Any:
        """Cast fp16/bf16 tensors in a model's outputs back to fp32, keeping container types (dicts, HF ModelOutput,
        namedtuples, other Mappings and dataclasses: mixprec.tree). No host sync."""
        return tree_map(_to_fp32, data)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, through the scaler (which multiplies by the scale for fp16). No host sync."""
        self.scaler.scale(loss).backward(**kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Leave the true gradients of ``optimizer``'s parameters in ``.grad`` (once per step, before
        clipping). No host sync."""
        gather_grads(optimizer)  # fp32 masters: their gradients first (a no-op without)
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """The update and the scale's: skipped when a gradient is non-finite (fp16). One host sync for the
        inf check when scaling (in ``update()`` instead, for fused optimizers); none otherwise."""
        gather_grads(optimizer)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        refresh_params(optimizer)  # fp32 masters back into the model's fp16/bf16 parameters
        return result

    def parameter_step(self, optimizer: torch.optim.Optimizer) -> Any:
        """``step_in_backward``: one parameter's update (``optimizer`` holds only it), not applied when its
        gradient is non-finite (the guard's check, on that gradient alone). :meth:`end_step` records the step."""
        return self.scaler.step(optimizer)

    def end_step(self) -> None:
        """``step_in_backward``: record the step whose parameters were updated during backward (skipped if
        any gradient was non-finite; the consecutive-skip breaker applies)."""
        self.scaler.update()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``optimizer_step`` left the parameters unchanged. No host sync."""
        return self.scaler.record.last_step_skipped

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this mode exactly: the scaler's state and step record."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (a state saved under a mode without loss scaling: fp16's scale
        starts afresh, its step record goes on)."""
        if "nonfinite_guard" in state and self.needs_loss_scaling:  # resumed into fp16 from another mode
            self.scaler.record.load_state_dict(state["record"])  # the scale starts afresh; the record goes on
            return
        self.scaler.load_state_dict(state)

    # -- reporting -----------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What this mode means, for logs and summaries."""
        return {
            "precision": self.name,
            "device": str(self.device),
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "loss_scaling": self.needs_loss_scaling,
            "master_weights": self.master_weights,
            "update_rounding": self.update_rounding,
            "reason": self.reason,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r}, reason={self.reason!r})"


def default_device() -> torch.device:
    """The one default-device rule: CUDA where torch sees it, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _to_fp32(leaf: Any) -> Any:
    return leaf.float() if isinstance(leaf, torch.Tensor) and leaf.dtype in _LOW_PRECISION else leaf


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
