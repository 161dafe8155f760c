"""``torch_compile`` measured on the run's own steps, and kept under "auto" only where it pays (issue 36 item 4).

On the project's 2-core CPU, ``mixprec train --compile`` made the 300-step main job 2x slower: the compile took
longer than the compiled steps could win back. The loop (:mod:`~mixprec.trainer.loop`) drives a
:class:`CompileGate` at each optimizer step, once the precision is decided (after "auto"'s race, which runs
eagerly: a compiled model would compile again for every candidate):

1. ``WARM_STEPS`` untimed eager steps, then ``TIMED_STEPS`` timed ones: the eager step (their median);
2. ``model.compile()``; the next step compiles (dynamo's counters time it, the backward's compile included);
   under "auto", if even a free compiled step could not win that time back over the steps left, the model
   goes back to eager at once;
3. ``TIMED_STEPS`` compiled steps (their median, less any compile inside them); under "auto" the rule
   (:func:`~mixprec.precision.compile_choice.compile_pays`) keeps the compiled model or goes back to eager.
   A run that cannot win its compile back stops paying for it: its evaluations would compile again (eval
   mode under no_grad is another graph: 5.3 s on the tiny GPT here), and so would a ragged last batch.

Every step runs in the mode the verdict so far allows, as a real training step; timing them costs a device
sync at both ends of the timed steps only (none on a CPU). Under "auto", figures an earlier run measured (its
cache, or the checkpoint a resumed run continues) that cannot pay over this run's steps skip the compile
altogether. A named precision compiles as asked: its figures are measured and reported all the same. Under
several processes each verdict is taken by all together (kept only if every process's figures say so), at
the same step everywhere.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.compile_choice import (
    ASKED,
    FAILED,
    KEPT,
    NOT_KEPT,
    SKIPPED,
    UNFINISHED,
    CompileFigures,
    compile_pays,
)
from mixprec.precision.trial import synchronize
from mixprec.trainer.phase_clock import compile_seconds

if TYPE_CHECKING:
    from mixprec.precision.decision import AutoDecision
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.context import RunContext

logger = logging.getLogger("mixprec.trainer")

WARM_STEPS = 1
"""Untimed eager steps first: the first step of a mode pays its one-time setup (kernels chosen, memory)."""
TIMED_STEPS = 3
"""Steps timed eager, and again compiled: the median of three is one neighbour's burst away from the truth."""


def compile_model(model: torch.nn.Module, args: TrainingArguments) -> None:
    """``model.compile()`` in place (torch's ``nn.Module.compile``: the module object stays the user's), with
    ``torch_compile_backend`` and ``torch_compile_mode``. The next call compiles; this one is cheap but for a
    process's first, which imports dynamo and inductor (3-11 s on this CPU under load)."""
    kwargs = {"backend": args.torch_compile_backend, "mode": args.torch_compile_mode}
    model.compile(**{k: v for k, v in kwargs.items() if v is not None})


def uncompile(model: torch.nn.Module) -> None:
    """Undo :func:`compile_model`: calls run the eager module again. torch has no public inverse of
    ``nn.Module.compile``, which sets ``_compiled_call_impl`` (None on the class: eager); its cached graphs
    stay with dynamo, so compiling again reuses them."""
    vars(model).pop("_compiled_call_impl", None)


class CompileGate:
    """The compile protocol over one ``train()``'s optimizer steps (see the module's docstring); off (every
    call a no-op) when the run does not compile."""

    _WAIT, _EAGER, _COMPILED, _DONE = range(4)

    def __init__(self, run: RunContext) -> None:
        self._run = run
        self._acc = run.accelerator
        self._phase = self._WAIT if run.args.torch_compile else self._DONE
        self._prior_read = False  # an earlier run's figures ("auto"'s decision) judged yet
        self._steps = 0  # steps into the current phase
        self._samples: list[float] = []
        self._eager_s: float | None = None
        self._compile_start = 0.0
        self._t0: float | None = None  # a timed step's start: wall clock, and dynamo's compile seconds
        self._c0 = 0.0
        self.figures: CompileFigures | None = None
        """The verdict and its figures, once taken (None: not compiling, or not yet)."""
        acc = self._acc
        self._agree: Callable[[bool], bool] = lambda flag: flag
        if acc.num_processes > 1:  # every process's figures must say keep (one tiny all-reduce per verdict)
            self._agree = lambda flag: bool(acc.reduce(int(flag), reduction="min").item())

    @property
    def gated(self) -> bool:
        """Whether the verdict is "auto"'s (compile only where it pays), not a named precision's (as asked)."""
        return self._acc.auto_decision is not None

    def step_begins(self) -> None:
        """An optimizer step begins (its first micro-batch, before the forward); times it when it is one of the
        timed steps. Host work only, plus a device sync on the timed steps."""
        if self._phase == self._DONE:
            return
        if self._phase == self._WAIT:
            if not self._acc.precision.decided:  # "auto" races (eagerly) first
                return
            self._phase = self._EAGER
            uncompile(self._run.model)  # compiled by an evaluation before training: eager until timed
        if not self._prior_read and self._acc.auto_decision is not None:
            self._read_prior(self._acc.auto_decision)
            if self._phase == self._DONE:
                return
        synchronize(self._acc.device)
        self._t0, self._c0 = time.perf_counter(), compile_seconds()

    def call(self, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)``, a micro-batch. On the first compiled step a failure of torch.compile itself (dynamo,
        or inductor, whose errors come unwrapped: a CPU without a working C++ compiler) is said, the model
        uncompiled and the micro-batch run again eagerly: nothing ran (the failure comes while tracing or
        compiling, before the forward computes), and the run goes on without compiling. A backend whose
        backward alone fails to compile raises from inside the backward, after the forward ran: not caught."""
        if self._phase != self._COMPILED or self._steps:
            return step(*args)
        try:
            return step(*args)
        except Exception as err:
            if not type(err).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            said = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            logger.warning("torch.compile failed on this model (%s: %s); training on eagerly", type(err).__name__, said)
            uncompile(self._run.model)
            self._settle(CompileFigures(FAILED, self._eager_s, failure=f"{type(err).__name__}: {said}"))
            return step(*args)

    def step_ended(self, steps_left: int) -> None:
        """The optimizer step is done, ``steps_left`` still to run: count it, and take the verdict it ends."""
        if self._t0 is None:
            return
        synchronize(self._acc.device)
        # a step's own time: any compile inside it (the first compiled step's, a recompile) is the compile's
        seconds = time.perf_counter() - self._t0 - (compile_seconds() - self._c0)
        self._t0 = None
        self._steps += 1
        if self._phase == self._EAGER:
            if self._steps > WARM_STEPS:
                self._samples.append(seconds)
            if len(self._samples) == TIMED_STEPS:
                self._eager_s = statistics.median(self._samples)
                self._samples, self._steps, self._phase = [], 0, self._COMPILED
                start = time.perf_counter()
                compile_model(self._run.model, self._run.args)  # a process's first imports dynamo and inductor
                setup = time.perf_counter() - start
                # part of the compile's cost, though dynamo's counters miss it; the loop laps "optimizer" next
                self._run.meter.phases.add_compile("optimizer", setup)
                self._compile_start = compile_seconds() - setup
            return
        compile_s = compile_seconds() - self._compile_start
        if self._steps == 1:  # the step that compiled: can any compiled step win that back?
            if self.gated and not self._agree(compile_pays(self._eager_s or 0.0, None, compile_s, steps_left)):
                self._finish(NOT_KEPT, None, compile_s, steps_left)
            return
        self._samples.append(seconds)
        if len(self._samples) == TIMED_STEPS:
            compiled = statistics.median(self._samples)
            verdict = ASKED
            if self.gated:
                pays = self._agree(compile_pays(self._eager_s or 0.0, compiled, compile_s, steps_left))
                verdict = KEPT if pays else NOT_KEPT
            self._finish(verdict, compiled, compile_s, steps_left)

    def summary(self, steps_left: int = 0) -> dict[str, Any] | None:
        """The verdict as the run's summary keeps it, at its end (``steps_left``: 0, or what a stop left): the
        one taken, or what was measured before the run ended; None when the run does not compile."""
        if self.figures is None and self._phase != self._DONE:
            compiling = self._phase == self._COMPILED
            compile_s = compile_seconds() - self._compile_start if compiling else None
            compiled = statistics.median(self._samples) if compiling and self._samples else None
            self._finish(ASKED if compiling and not self.gated else UNFINISHED, compiled, compile_s, steps_left)
        figures = self.figures
        return None if figures is None else {**figures.to_dict(), "explain": figures.explain()}

    # -- the verdicts --------------------------------------------------------------------------------

    def _read_prior(self, decision: AutoDecision) -> None:
        """ "auto" has decided (at the step that starts the gate, or a later one: a race of one candidate is
        decided at once but chooses at its end): figures an earlier run measured may skip the compile."""
        self._prior_read = True
        if self._phase != self._EAGER:
            return
        prior = CompileFigures.from_dict(decision.compile) if decision.compile else None
        steps_left = self._run.state.max_steps - self._run.state.global_step
        # asked of every process, figures or none (each reads its own cache): skipped only if all say so
        if self._agree(prior is not None and prior.cannot_pay(steps_left)) and prior is not None:
            source = prior.source if prior.source != "measured" else decision.source  # "cache", or "checkpoint"
            figures = CompileFigures(
                SKIPPED, prior.eager_step_s, prior.compiled_step_s, prior.compile_s, steps_left, source=source
            )
            self._settle(figures)

    def _finish(self, verdict: str, compiled_s: float | None, compile_s: float | None, steps_left: int) -> None:
        if verdict == NOT_KEPT:
            uncompile(self._run.model)  # trains on eagerly: its compiled graphs are never called again
        self._settle(CompileFigures(verdict, self._eager_s, compiled_s, compile_s, steps_left))

    def _settle(self, figures: CompileFigures) -> None:
        self.figures, self._phase, self._t0 = figures, self._DONE, None
        self._acc.note_compile(figures)  # "auto": into its decision (and cache); a named mode keeps none
        run = self._run
        run.events.record("compile", run.state.global_step, **figures.to_dict())
        logger.info("%s", figures.explain())
