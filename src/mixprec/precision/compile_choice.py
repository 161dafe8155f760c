"""Whether ``torch.compile`` pays on a run (issue 36 item 4): the rule, and the figures it is judged on.

On the project's 2-core CPU, ``mixprec train --compile`` made the 300-step main job 2x slower: inductor's C++
kernels took longer to compile than the compiled steps could win back. So under precision "auto", a run that
asks for compile measures it on its own steps (:mod:`mixprec.trainer.compile_gate`: the eager step of the
chosen mode, then the compile and the compiled step) and keeps the compiled model only where

    (eager step - compiled step) x steps left  >  compile time

else it trains on eagerly. The figures join auto's decision (its explanation, checkpoints, the summary) and
its cache, under the race's key and the chosen mode, so that a later run of the same model, batch and
machine that cannot pay skips the compile and says so. A precision named by the user compiles as asked; its
figures are still measured and reported, and a compiled step slower than the eager one is said aloud.

The clock is the wall clock for all three figures: the compile's is dynamo's own (wall) time, and a gain must
be in the same seconds to be weighed against it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KEPT = "kept"
NOT_KEPT = "not kept"
SKIPPED = "skipped"
ASKED = "kept as asked"
UNFINISHED = "no verdict"
FAILED = "failed"  # torch.compile raised at the first compiled step: the run went on eagerly


def compile_pays(eager_step_s: float, compiled_step_s: float | None, compile_s: float, steps_left: int) -> bool:
    """Whether compiling wins back its compile time over ``steps_left`` steps: the per-step gain (eager minus
    compiled) times the steps, against ``compile_s``. With no compiled step measured (None), the most it could
    gain: the whole eager step (a compiled step of no time at all)."""
    step = 0.0 if compiled_step_s is None else compiled_step_s
    return (eager_step_s - step) * max(0, steps_left) > compile_s


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if abs(seconds) >= 1 else f"{seconds:.2f} s"


@dataclass(frozen=True)
class CompileFigures:
    """What compiling measured on a run and what was done: JSON-ready (``to_dict``) for the decision, the
    cache, ``metrics.jsonl`` and the summary. Seconds on the wall clock; ``steps_left`` is the run's optimizer
    steps still to come when the verdict was taken."""

    verdict: str
    eager_step_s: float | None = None
    compiled_step_s: float | None = None  # None: the verdict came before a compiled step was timed
    compile_s: float | None = None
    steps_left: int = 0
    source: str = "measured"  # "measured" on this run, or "cache" / "checkpoint" (an earlier run's figures)
    failure: str = ""  # FAILED: what torch.compile raised (its first line)

    @property
    def slower(self) -> bool:
        """Whether the compiled step was measured slower than the eager one."""
        return None not in (self.compiled_step_s, self.eager_step_s) and self.compiled_step_s >= self.eager_step_s

    def pays(self, steps_left: int | None = None) -> bool:
        """The rule (:func:`compile_pays`) on these figures, over ``steps_left`` (default: their own)."""
        if self.eager_step_s is None or self.compile_s is None:
            return False
        steps = self.steps_left if steps_left is None else steps_left
        return compile_pays(self.eager_step_s, self.compiled_step_s, self.compile_s, steps)

    def cannot_pay(self, steps_left: int) -> bool:
        """Whether these figures (an earlier run's) say compiling cannot pay over ``steps_left`` steps; False
        where they lack a compile time or an eager step to judge by."""
        return self.eager_step_s is not None and self.compile_s is not None and not self.pays(steps_left)

    def weighed(self, steps_left: int | None = None) -> str:
        """The rule written out: "1.3 ms/step gain x 280 steps = 0.4 s < 21.0 s to compile"."""
        if self.eager_step_s is None or self.compile_s is None:
            return "nothing measured"
        steps = self.steps_left if steps_left is None else steps_left
        if self.compiled_step_s is None:  # no compiled step timed: the most it could gain, a whole eager step
            gain, what = self.eager_step_s, f"at most {_ms(self.eager_step_s)}/step (a whole eager step)"
        elif self.slower:
            return f"no gain to win {_s(self.compile_s)} of compile back: the compiled step is no faster"
        else:
            gain = self.eager_step_s - self.compiled_step_s
            what = f"{_ms(gain)}/step gain"
        sign = ">" if self.pays(steps) else "<"
        return f"{what} x {steps} steps = {_s(gain * max(0, steps))} {sign} {_s(self.compile_s)} to compile"

    def steps_text(self) -> str:
        """The step times measured: "eager 30.1 ms a step, compiled 28.8 ms" (", slower than eager" if so)."""
        if self.eager_step_s is None:
            return "no step timed"
        text = f"eager {_ms(self.eager_step_s)} a step"
        if self.compiled_step_s is not None:
            text += f", compiled {_ms(self.compiled_step_s)}" + (", slower than eager" if self.slower else "")
        return text

    def explain(self) -> str:
        """One clause for a decision or a summary: the verdict and the figures it rests on."""
        if self.verdict == FAILED:
            return f"compile: failed at the first compiled step ({self.failure}); the run trained on eagerly"
        if self.verdict == UNFINISHED and self.compile_s is None:
            return "compile: not measured: the run ended before its eager steps were timed, so it was never compiled"
        if self.verdict == UNFINISHED:
            return f"compile: no verdict, the run ended first: {self.compile_s:.1f} s to compile; {self.steps_text()}"
        if self.source != "measured" and self.verdict != SKIPPED:  # an earlier run's, before this run's verdict
            return (
                f"compile: an earlier run ({self.source}) measured {self.steps_text()} and "
                f"{self.compile_s or 0.0:.1f} s to compile; there: {self.verdict}"
            )
        if self.verdict == SKIPPED:
            return (
                f"compile: skipped: the {self.source}'s figures ({self.steps_text()}, {self.compile_s:.1f} s "
                f"to compile) cannot pay over this run: {self.weighed()}"
            )
        if self.verdict == ASKED:
            took = f"{self.compile_s:.1f} s to compile" if self.compile_s is not None else "not compiled yet"
            return f"compile: {ASKED} (a named precision): {took}; {self.steps_text()}"
        return f"compile: {self.verdict}: {self.weighed()} ({self.steps_text()})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompileFigures:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
