"""Where the current step stands: which micro-batch, whether it syncs and steps, what has been unscaled.

Shared by the facade and the prepared optimizers, schedulers and DataLoaders, so that they agree on the
accumulation schedule without asking each other:

- ``accumulate(models)`` counts micro-batches; the ``gradient_accumulation_steps``-th one (or the last
  batch of the DataLoader) is a *sync* micro-batch: gradients are all-reduced, the optimizer steps, the
  scheduler advances. On the others DDP/FSDP skip their gradient communication (``no_sync``).
- ``clip_grad_norm_`` unscales each optimizer's gradients at most once per step (the scaler refuses a
  second ``unscale_``), and the norm it returns is that of the true gradients.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mixprec.precision.master_weights import master_map

if TYPE_CHECKING:
    from mixprec.precision.base import Precision
    from mixprec.strategies.strategy import DistributedStrategy


class PreparedOptimizer(Protocol):
    """What the accumulation state reads of a prepared optimizer (:class:`~mixprec.accelerator.prepared.
    PreparedOptimizer` holds this state: the arrow points from it to here, never back)."""

    optimizer: torch.optim.Optimizer
    """The optimizer the step runs (the precision's conversion of the user's)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


@dataclass
class GradientAccumulationPlugin:
    """``Accelerator(gradient_accumulation_plugin=...)``: HF Accelerate's accumulation settings."""

    num_steps: int = 1
    """Micro-batches summed per optimizer step (what ``gradient_accumulation_steps`` sets)."""

    adjust_scheduler: bool = True
    """Accepted for accelerate's scripts: a prepared LR scheduler advances once per optimizer step either way
    (mixprec's never counts the micro-batches that only accumulate)."""

    sync_with_dataloader: bool = True
    """The last batch of a prepared DataLoader ends the accumulation window (steps the optimizer)."""

    sync_each_batch: bool = False
    """Under DDP/FSDP2, all-reduce gradients on every micro-batch (less memory, more communication); the
    optimizer still steps once per window."""

    def __post_init__(self) -> None:
        steps = self.num_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"GradientAccumulationPlugin(num_steps={steps!r}): num_steps must be an integer >= 1")


class GradientState:
    """The accumulation counter and the per-step bookkeeping of one Accelerator (``accelerator.gradient_state``:
    ``sync_gradients``, ``end_of_dataloader``, ``num_steps``... as in HF Accelerate)."""

    def __init__(
        self,
        precision: Precision,
        strategy: DistributedStrategy,
        accumulation_steps: int,
        plugin: GradientAccumulationPlugin | None = None,
    ) -> None:
        plugin = plugin or GradientAccumulationPlugin(accumulation_steps)
        self.precision = precision  # owns the step: backward, unscale, optimizer step, the scaler
        self.strategy = strategy
        self.accumulation_steps = plugin.num_steps
        self.adjust_scheduler = plugin.adjust_scheduler
        self.sync_with_dataloader = plugin.sync_with_dataloader
        self.sync_each_batch = plugin.sync_each_batch
        self.divide_loss = True
        """``backward`` divides the loss by the accumulation steps (accelerate's rule for a hand-written loop).
        The Trainer turns it off and divides in ``training_step`` instead, as HF's Trainer does, so a loss a
        ``training_step`` override backpropagates itself is taken as it is given there."""
        self.micro_step = 0  # micro-batches since the last sync
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.backward_pending = False  # a scaled backward since the last optimizer step
        self.optimizers: list[PreparedOptimizer] = []
        self._in_accumulate = False
        self._warned_outside = False
        self._unscaled: set[int] = set()
        self._owners: dict[int, PreparedOptimizer] | None = None

    @property
    def num_steps(self) -> int:
        """HF Accelerate's name for ``accumulation_steps``."""
        return self.accumulation_steps

    @num_steps.setter
    def num_steps(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps = {steps!r}: must be an integer >= 1")
        self.accumulation_steps = steps

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return {
            "num_steps": self.accumulation_steps,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }

    # -- backward and accumulation -------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale the loss (fp16), divide it by the accumulation steps (see ``divide_loss``), backpropagate.
        No host sync."""
        if self.accumulation_steps > 1 and self.divide_loss:
            if not self._in_accumulate and not self._warned_outside:
                self._warned_outside = True
                warnings.warn(
                    f"gradient_accumulation_steps={self.accumulation_steps} but backward() was called outside "
                    "`with accelerator.accumulate(model):`, so every micro-batch steps the optimizer; wrap the "
                    "step in accumulate(model)",
                    stacklevel=3,
                )
            loss = loss / self.accumulation_steps
        self.precision.backward(loss, **kwargs)
        self.backward_pending = True

    @contextlib.contextmanager
    def accumulate(self, models: Iterable[torch.nn.Module]) -> Iterator[None]:
        self.micro_step += 1
        at_end = self.end_of_dataloader and self.sync_with_dataloader
        self.sync_gradients = self.micro_step >= self.accumulation_steps or at_end
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients and not self.sync_each_batch:
                for model in models:
                    stack.enter_context(self.strategy.no_sync(model))
            self._in_accumulate = True
            try:
                yield
            finally:
                self._in_accumulate = False
        if self.sync_gradients:
            self.micro_step = 0

    # -- clipping ------------------------------------------------------------------------------------

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (once per step), clip, and return the total norm of the true gradients before clipping.

        On a micro-batch that only accumulates, nothing is clipped (the sum is not complete) and the norm of
        the partial sum is returned. No host sync (the norm stays on the device).
        """
        params = parameters_of(parameters)
        if not self.sync_gradients:
            return self.strategy.grad_norm(params, norm_type) / self.precision.scaler.get_scale()
        params = self.unscale_for(params)
        return self.strategy.clip_grad_norm_(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        params = parameters_of(parameters)
        if self.sync_gradients:
            params = self.unscale_for(params)
            torch.nn.utils.clip_grad_value_(params, clip_value)

    def unscale_for(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Unscale the gradients of every prepared optimizer holding one of ``params``, once per step; return
        the tensors holding the step's gradients: ``params``, each fp16/bf16 one with an fp32 master replaced
        by its master (see :mod:`mixprec.precision.master_weights`), so clipping clips what the step uses."""
        owners = self._owner_map()
        with_grads = [id(p) for p in params if p.grad is not None]
        orphans = sum(i not in owners for i in with_grads)
        if orphans and self.precision.needs_loss_scaling:
            raise ValueError(
                f"clip_grad_norm_: {orphans} of these parameters belong to no prepared optimizer, so their "
                "gradients cannot be unscaled before clipping; pass the optimizer to accelerator.prepare()"
            )
        self.unscale_optimizers([owners[i] for i in with_grads if i in owners])  # each once: it skips repeats
        masters = {i: m for opt in self.optimizers for i, m in master_map(opt.optimizer).items()}
        return [masters.get(id(p), p) for p in params] if masters else params

    def unscale_optimizers(self, optimizers: list[PreparedOptimizer] | None = None) -> None:
        """Unscale the gradients of ``optimizers`` (default: every prepared one), each at most once per step."""
        for optimizer in self.optimizers if optimizers is None else optimizers:
            if id(optimizer) not in self._unscaled:
                self.precision.unscale(optimizer.optimizer)
                self._unscaled.add(id(optimizer))

    def _owner_map(self) -> dict[int, PreparedOptimizer]:
        if self._owners is None:
            self._owners = {
                id(p): opt for opt in self.optimizers for group in opt.param_groups for p in group["params"]
            }
            # a model parameter stepped through its fp32 master belongs to the master's optimizer
            self._owners.update({i: opt for opt in self.optimizers for i in master_map(opt.optimizer)})
        return self._owners

    def forget_owners(self) -> None:
        """Call when an optimizer's parameters change (add_param_group)."""
        self._owners = None

    def forget_optimizers(self) -> None:
        """Drop every reference to prepared optimizers (``free_memory``)."""
        self.optimizers.clear()
        self._unscaled.clear()
        self._owners = None

    # -- step bookkeeping ----------------------------------------------------------------------------

    def stepped(self, optimizer: PreparedOptimizer) -> None:
        self._unscaled.discard(id(optimizer))
        self.backward_pending = False

    def dropped(self, optimizer: PreparedOptimizer) -> None:
        """``optimizer``'s gradients are zeroed without a step (a batch left out after clipping): the next
        step's gradients are unscaled and checked afresh, not stepped on this one's check."""
        if id(optimizer) in self._unscaled:
            self._unscaled.discard(id(optimizer))
            self.precision.scaler.forget(optimizer.optimizer)

    def state_dict(self) -> dict[str, int]:
        return {"micro_step": self.micro_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_step = int(state.get("micro_step", 0))


def parameters_of(objects: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """A list from a tensor, a list or a generator of parameters (generators can be read once)."""
    return [objects] if isinstance(objects, torch.Tensor) else list(objects)
