"""A public, per-step record of what the loss scaler did.

Schedulers, loggers and EMA need to know whether the optimizer really stepped. The record is written on
the host by :meth:`GradScaler.update` from the skip decision the step already synced, so reading it never
forces a device sync, and it is right for fused optimizers (which skip on the device) as for the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ConsecutiveSkipsError(RuntimeError):
    """Too many optimizer steps in a row were skipped for non-finite gradients."""


@dataclass(frozen=True)
class StepEntry:
    """One optimizer step: its index (from 0), the loss scale it ran with, and whether it was skipped."""

    step: int
    scale: float
    skipped: bool


@dataclass
class ScaleRecord:
    """Counters and a bounded history of recent steps (``history_size`` entries at most)."""

    history_size: int = 1000
    """How many recent steps ``history`` keeps."""
    steps: int = 0
    """Optimizer steps recorded, skipped ones included."""
    skipped_steps: int = 0
    """Steps skipped because a gradient was inf or NaN."""
    consecutive_skips: int = 0
    """Skipped steps in a row up to the last one (0 after a step that applied)."""
    last_step_skipped: bool = False
    """Whether the last step was skipped: read it instead of comparing scales (no host sync)."""
    scale: float = 1.0
    """The loss scale after the last update (a host copy: reading it never syncs)."""
    history: deque[StepEntry] = field(default_factory=deque)
    """The last ``history_size`` steps: each its index, the scale it used and whether it was skipped."""

    def __post_init__(self) -> None:
        if self.history_size < 1:
            raise ValueError(f"history_size must be >= 1, got {self.history_size}")
        self.history = deque(self.history, maxlen=self.history_size)

    def add(self, scale_used: float, skipped: bool, scale_after: float) -> StepEntry:
        """Record one optimizer step (the scaler calls it; no host sync): its scale, whether it was skipped."""
        entry = StepEntry(self.steps, scale_used, skipped)
        self.history.append(entry)
        self.steps += 1
        self.last_step_skipped = skipped
        self.scale = scale_after
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0
        return entry

    def raise_if_too_many_skips(
        self, skipped: bool, limit: int | None, names: Callable[[], list[str]], state: str, advice: str
    ) -> None:
        """Raise :class:`ConsecutiveSkipsError` once ``limit`` steps in a row were skipped (``None``: never),
        naming the parameters whose gradients are non-finite (``names``, read only then: it syncs)."""
        if skipped and limit is not None and self.consecutive_skips >= limit:
            found = names()
            raise ConsecutiveSkipsError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped for non-finite gradients "
                f"({state}). Non-finite gradients in: {', '.join(found[:20]) or 'none left (were they zeroed?)'}"
                f"{' ...' if len(found) > 20 else ''}. {advice}"
            )

    @property
    def applied_steps(self) -> int:
        """Steps whose update reached the parameters."""
        return self.steps - self.skipped_steps

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: plain ints, floats, bools and lists."""
        return {
            "history_size": self.history_size,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "last_step_skipped": self.last_step_skipped,
            "scale": self.scale,
            "history": [[e.step, e.scale, e.skipped] for e in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the counts and history of :meth:`state_dict`'s output."""
        self.history_size = int(state.get("history_size", self.history_size))
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.last_step_skipped = bool(state["last_step_skipped"])
        self.scale = float(state["scale"])
        entries = (StepEntry(int(s), float(sc), bool(sk)) for s, sc, sk in state.get("history", []))
        self.history = deque(entries, maxlen=self.history_size)
