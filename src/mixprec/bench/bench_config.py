"""What a precision benchmark runs: a typed, validated config."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.precision.registry import canonical_name

DEFAULT_PRECISIONS = ("fp32", "fp16", "bf16", "auto")


@dataclass
class BenchConfig:
    """How :func:`mixprec.bench.run_bench` measures. Every field is validated in ``__post_init__``."""

    precisions: tuple[str, ...] = DEFAULT_PRECISIONS
    """Precision names to compare (any spelling ``resolve_precision`` takes). "auto" is resolved once and
    shares the measurement of the mode it picks when that mode is in the list too."""
    steps: int = 2
    """Timed optimizer steps per precision per round."""
    rounds: int = 3
    """Interleaved rounds: each round runs every precision for ``steps`` steps, starting from a different
    precision each round, so a noisy neighbour or a thermal trend hurts every precision alike."""
    warmup: int = 1
    """Untimed steps per precision before the first round (kernel selection, allocator, lazy optimizer state)."""
    lr: float = 1e-3
    """AdamW learning rate; every precision uses the same."""
    memory_steps: int = 2
    """Steps run when measuring peak memory (2: the second step has the optimizer state *and* activations)."""
    measure_memory: bool = True
    """Measure peak memory (on a CPU each precision in a fresh subprocess: a few seconds each)."""
    measure_peak: bool = True
    """Run the matmul probe per compute dtype for MFU."""

    def __post_init__(self) -> None:
        if isinstance(self.precisions, str):
            self.precisions = tuple(p.strip() for p in self.precisions.split(",") if p.strip())
        self.precisions = tuple(self.precisions)
        if not self.precisions:
            raise ValueError("BenchConfig.precisions must name at least one precision")
        try:
            canon = [canonical_name(p) for p in self.precisions]
        except ValueError as exc:
            raise ValueError(f"BenchConfig.precisions: {exc}") from None
        if len(set(canon)) != len(canon):
            raise ValueError(f"BenchConfig.precisions lists a precision twice: {', '.join(self.precisions)}")
        for name, low in (("steps", 1), ("rounds", 1), ("warmup", 0), ("memory_steps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"BenchConfig.{name} must be an integer >= {low}, got {value!r}")
        if not float(self.lr) > 0:
            raise ValueError(f"BenchConfig.lr must be > 0, got {self.lr!r}")
