"""precision="auto" where a training step exists: decided by racing the candidates on that step.

``AutoPrecision`` is the strategy an Accelerator holds for "auto". Until :meth:`settle` it runs as its safest
candidate (fp32); ``settle(loss_fn, models)`` races every candidate on ``loss_fn``, the user's own forward and
backward on the first training batch (:mod:`~mixprec.precision.race`), and from then on every hook delegates to
the chosen strategy. The Trainer calls ``settle`` before its first step; in a hand-written Accelerator loop the
prepared model's first training forward calls :meth:`begin_step`.

Raced aside, each trial restores gradients, buffers and RNG states (:mod:`~mixprec.precision.trial`); raced as
the run's steps (inrun.py), the Trainer replays them in the chosen mode (trainer/race_rewind.py; a hand-written
loop keeps them). Either way the run is bit-identical to one that named the chosen mode. A decision is made once
per run: a resume adopts the checkpoint's (:meth:`adopt`), every process takes the main one's, and a repeated
run may reuse a cached one (:mod:`~mixprec.precision.auto_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision import auto_cache
from mixprec.precision.announcement import RunContext
from mixprec.precision.base import Precision
from mixprec.precision.compile_choice import CompileFigures
from mixprec.precision.decision import AutoDecision, excluded_by_format
from mixprec.precision.inrun import InRunRace, in_run_plan, too_short_to_race
from mixprec.precision.master_weights import master_names
from mixprec.precision.op_timing import measure_op_kinds, op_timing_budget, op_timing_skipped, policy_candidate
from mixprec.precision.policy import recorded_policy
from mixprec.precision.probe import emulated_candidates
from mixprec.precision.race import MAX_ROUNDS, Agree, Clock, Unfinished, decide, decide_steps, recheck, reuse
from mixprec.precision.race_step import SCALE_BACKOFF, Optimizers, RaceSteps
from mixprec.precision.trial import no_trace, race_clock, run_trial

if TYPE_CHECKING:
    from mixprec.scaling.scaler import GradScaler

_POLICY_BASE = "bf16"  # the base of the policy the per-op-kind timing builds (issue 23, op_timing.py)


class AutoPrecision(Precision):
    """ "auto": the fastest safe candidate, measured on the training step; the safest one until then."""

    _NOW = "The current mode's (the safest candidate's before the race, a trial's during it, then the choice's)."
    update_rounding = property(lambda self: self.current.update_rounding, doc=_NOW)  # type: ignore[assignment]
    hf_flags = property(lambda self: self.current.hf_flags, doc=_NOW)  # type: ignore[assignment]
    compute_dtype = property(lambda self: self.current.compute_dtype, doc=_NOW)  # type: ignore[assignment]
    param_dtype = property(lambda self: self.current.param_dtype, doc=_NOW)  # type: ignore[assignment]
    needs_loss_scaling = property(lambda self: self.current.needs_loss_scaling, doc=_NOW)  # type: ignore[assignment]

    def __init__(self, candidates: Sequence[Precision], *, processes: int = 1, op_policy: bool | None = None) -> None:
        if not candidates:
            raise ValueError("precision='auto' needs at least one candidate mode")
        self.candidates = sorted(candidates, key=lambda p: p.safety_rank)
        self.decision: AutoDecision | None = None
        self._chosen: Precision | None = None
        self._trying: Precision | None = None
        self._left_out: dict[str, str] = {}  # candidates the run cannot train (leave_out), with why
        super().__init__(self.candidates[0].device)
        self.processes = processes
        self._agree: Agree | None = None
        self._is_main = True
        self._param_names: list[tuple[str, torch.nn.Parameter]] = []
        self._in_run: RaceSteps | None = None  # its steps are transactions (race_step.py)
        self._optimizers = Optimizers()  # the converted ones: an in-run race step that raises puts them back
        self._stepped: Precision | None = None  # the mode that ran the last optimizer step
        self.cache_key: str | None = None  # the race's key in the cache (auto_cache.py); None with the cache off
        self._compile_asked = False  # the run compiles where it pays: an earlier run's figures join the decision
        # a measured per-op policy races where bf16 autocast does (op_timing.py; MIXPREC_AUTO_OP_POLICY=0: uniform)
        op_policy = os.environ.get("MIXPREC_AUTO_OP_POLICY", "1") != "0" if op_policy is None else op_policy
        self.op_policy = op_policy and any(p.name == _POLICY_BASE for p in self.candidates)
        # a CPU mode the GEMM probe shows emulated is left out untried (probe.py; =0: planted-speed tests race all)
        self.prefilter = os.environ.get("MIXPREC_AUTO_PREFILTER", "1") != "0"

    def bind(self, device: torch.device, processes: int = 1) -> None:
        """As the base, for every candidate too; the race learns how many processes run it in lockstep."""
        for candidate in self.candidates:
            candidate.bind(device)
        super().bind(device)
        self.processes = processes

    # -- what it is now ------------------------------------------------------------------------------

    @property
    def current(self) -> Precision:
        """The strategy the hooks delegate to: a trial's, the chosen one, or the safest before the race."""
        return self._trying or self._chosen or self.candidates[0]

    @property
    def pending(self) -> bool:  # type: ignore[override]
        # not during a trial: the trial's forward goes through the same prepared forward that settles
        return self.decision is None and self._trying is None and self._in_run is None

    @property
    def resolved(self) -> Precision:  # type: ignore[override]
        return self._chosen or self

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._chosen.name if self._chosen is not None else "auto"

    @property
    def reason(self) -> str:  # type: ignore[override]
        """Where the decision stands: not decided yet, racing as the run's steps, or the decision explained."""
        names = ", ".join(p.name for p in self.candidates)
        if self._in_run is not None:
            return f"auto: racing {names} as the run's training steps ({self._in_run.steps} so far)"
        if self.decision is None:
            return f"auto: not decided yet; the first training step will race {names} and keep the fastest"
        return self.decision.explain()

    @reason.setter
    def reason(self, value: str) -> None:  # the base __init__ sets a default: auto's reason is its decision
        pass

    # -- configuration, forwarded to every candidate ------------------------------------------------

    def configure(
        self,
        scaler_kwargs: Mapping[str, Any] | None = None,
        found_inf_reducer: Callable[[torch.Tensor], None] | None = None,
        agree: Agree | None = None,
        is_main: bool = True,
        run: RunContext | None = None,
    ) -> None:
        """As the base, plus ``agree`` (several processes: the main one's list of names for everyone) and whether
        this is the main process (whose measurement is everyone's); ``run``'s line is said again once decided."""
        super().configure(scaler_kwargs, found_inf_reducer, run=run)
        self._agree = agree
        self._is_main = is_main
        for p in self.candidates:
            p.configure(scaler_kwargs, found_inf_reducer)

    @property
    def scaler(self) -> GradScaler:  # type: ignore[override]
        return self.current.scaler

    def register_param_names(self, named_parameters: Any) -> None:
        named = list(named_parameters)
        self._param_names.extend(named)
        for p in self.candidates:
            p.register_param_names(named)

    def forget_parameters(self) -> None:
        self._param_names.clear()
        for p in self.candidates:
            p.forget_parameters()

    def _add_candidate(self, candidate: Precision | None) -> None:
        """A measured policy joins the candidates, configured like them (None, or one already there: nothing)."""
        if candidate is None or candidate.name in [p.name for p in self.candidates]:
            return
        candidate.configure(getattr(self, "_scaler_kwargs", None), getattr(self, "_found_inf_reducer", None))
        candidate.register_param_names(self._param_names)
        self.candidates = sorted([*self.candidates, candidate], key=lambda p: p.safety_rank)

    def options(self) -> list[Precision]:
        return [self._chosen] if self._chosen is not None else list(self.candidates)

    def leave_out(self, unfit: Callable[[Precision], bool], why: str) -> None:
        if self.decision is None and not unfit(self.candidates[0]):  # the safest (fp32) is fit for any run
            self._left_out.update({p.name: why for p in self.candidates if unfit(p)})
            self.candidates = [p for p in self.candidates if not unfit(p)]

    in_trial = property(lambda self: self._trying is not None and self._in_run is None)  # type: ignore[assignment]

    # -- the hooks: the current strategy's ---------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.current.convert_module(module)

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        converted = self.current.convert_optimizer(optimizer)
        self._optimizers.add(converted)
        # fp32 masters (master_weights.py) named to every candidate's scaler, whichever the race picks
        self.register_param_names(master_names(converted, list(self._param_names)))
        return converted

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._in_run is not None and self._in_run.in_step:  # a race step's forward: undone if it raises
            return self._undo_on_error(self.current.autocast())
        return self.current.autocast()

    def convert_output(self, data: Any) -> Any:
        return self.current.convert_output(data)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        with self._undo_on_error():
            self.current.backward(loss, **kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        with self._undo_on_error():
            self.current.unscale(optimizer)
        if self._in_run is not None and self._in_run.in_step:  # before clipping: fp16's first scale (race_step.py)
            self._in_run.note_gradients(self.current)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        self._stepped = self.current
        with self._undo_on_error():
            result = self.current.optimizer_step(optimizer, **kwargs)
        self._end_race_step()
        return result

    def end_step(self) -> None:
        self._stepped = self.current
        with self._undo_on_error():
            self.current.end_step()
        self._end_race_step()

    @property
    def step_was_skipped(self) -> bool:  # type: ignore[override]
        return (self._stepped or self.current).step_was_skipped

    # -- the race as the run's own steps (inrun.py) --------------------------------------------------

    def begin_step(self, loss_fn: Callable[[], torch.Tensor], models: Any, **facts: Any) -> None:
        """A training step begins (its first training forward): undecided, race on it (:meth:`settle`); under the
        in-run race, run it in the mode the race names next. A no-op otherwise, or inside a step already begun."""
        if self.pending:
            self.settle(loss_fn, models, **facts)
        if self._in_run is not None and not self._in_run.in_step:
            self._trying = self._in_run.begin()

    def _end_race_step(self) -> None:
        if self._in_run is not None and self._in_run.in_step:
            ran, self._trying = self.current, None
            self._in_run.end(ran)

    @contextlib.contextmanager
    def _undo_on_error(self, inner: contextlib.AbstractContextManager[Any] | None = None) -> Iterator[None]:
        """A hook of an in-run race step (inside ``inner``): if it raises, the step is undone and its mode leaves
        the race (race_step.py); the error goes on."""
        try:
            with inner if inner is not None else contextlib.nullcontext():
                yield
        except Exception as err:
            if self._in_run is not None and self._in_run.in_step:
                failed, self._trying = self.current, None
                self._in_run.abort(failed, err)
            raise

    def state_dict(self) -> dict[str, Any]:
        return self.current.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        out = {**self.current.describe(), "precision": self.name, "reason": self.reason}
        if self.decision is not None:
            out["auto"] = self.decision.to_dict()
        return out

    def decision_record(self) -> dict[str, Any] | None:
        return None if self.decision is None else self.decision.to_dict()

    # -- the decision --------------------------------------------------------------------------------

    def settle(
        self,
        loss_fn: Callable[[], torch.Tensor],
        models: Sequence[torch.nn.Module],
        *,
        batch: Any = None,
        excluded: Mapping[str, str] | None = None,
        unsafe_formats: Mapping[str, str] | None = None,
        rounds: int = MAX_ROUNDS,
        clock: Clock | None = None,
        use_cache: bool = True,
        run_steps: int | None = None,
        in_run: bool | None = None,
        passes_per_step: int = 1,
        compile_asked: bool = False,
        quiet_steps: int | None = None,
    ) -> AutoDecision | None:
        """Race the candidates on ``loss_fn`` (one forward of the real step, returning its loss), adopt the
        winner, return the decision; a no-op once decided. ``excluded`` names candidates that may not win, with
        why; ``unsafe_formats`` formats so (a diagnosis saw fp16 overflow); ``run_steps`` (the run's length, if
        known) caps the race at a share of it; ``clock`` defaults to ``race_clock``'s. A cached decision is
        re-checked by timing its chosen mode. Costs a few passes and host syncs, once per run; ``models`` and the
        RNG are left as found. ``in_run`` races as the run's first steps instead (inrun.py; returns None: the
        decision comes at the step that ends the race, each step begins with :meth:`begin_step`); by default
        where the run is known (``run_steps`` passes, ``passes_per_step`` a step), not among the shortest, every
        candidate keeps fp32 weights, and the race ends before ``quiet_steps`` (``in_run_plan``). ``compile_asked``:
        the run compiles where it pays; what that cost before joins the decision."""
        if self.decision is not None or self._in_run is not None:
            return self.decision
        steps_left = None if run_steps is None else run_steps // max(1, passes_per_step)
        if (short := too_short_to_race(steps_left, self.candidates, in_run)) is not None:
            self.adopt(short)  # the safest, unraced: no race could win back its cost
            return self.decision
        clock_name = "given clock"
        if clock is None:
            clock, clock_name = race_clock(self.device)
        # several processes run every trial in lockstep (a backward is a collective): none stops early
        alone = self._agree is None
        op_policy = self.op_policy and alone  # several processes' forward-only replays would have to agree too
        names = [p.name for p in self.candidates]
        key_names = [*names, "op-policy"] if op_policy else names
        key = auto_cache.fingerprint(self.device, models, auto_cache.shapes_of(batch), key_names, self.processes)
        self.cache_key, self._compile_asked = (key if use_cache else None), compile_asked
        cached = auto_cache.lookup(key) if use_cache else None
        if op_policy and cached is not None:
            self._add_candidate(recorded_policy(cached.chosen, names, self.device))  # a cached race's policy
            names = [p.name for p in self.candidates]  # safest first, the policy in its place
        same = self._agree or (lambda xs: xs)
        hit = same([cached.chosen] if cached is not None and cached.chosen in names else [])
        by_name = {p.name: p for p in self.candidates}
        scales = {p.name: (p.scaler.get_scale() if p.needs_loss_scaling else 1.0) for p in self.candidates}

        with no_trace(models, self.device) as state:

            def run(name: str, deadline: float | None) -> bool | Unfinished:
                while True:
                    finite = run_trial(
                        by_name[name],
                        loss_fn,
                        state,
                        self._selecting,
                        scales[name],
                        deadline=deadline if alone else None,
                        clock=clock,
                    )
                    # An fp16 overflow at a large loss scale is what the scaler backs off from: retry lower,
                    # and exclude fp16 only if it overflows unscaled.
                    if finite is not False or scales[name] <= 1.0:
                        return finite
                    scales[name] = max(scales[name] * SCALE_BACKOFF, 1.0)

            stale = ""
            if hit:  # a cached decision is checked, not trusted (issue 29); the main process's is taken
                check = (lambda d: recheck(d, run, clock, clock_name)) if alone else None
                reused, stale = reuse(hit[0], cached, self.device.type, check)
                if reused is not None:
                    self.adopt(reused)
                    return self.decision

            unsafe = excluded_by_format(self.candidates, unsafe_formats or {})  # by the formats they compute in
            excluded = {**self._left_out, **unsafe, **(excluded or {})}
            if self.prefilter:  # every process leaves out what the main one's probe found (the same trials for all)
                found = same([f"{k}\n{v}" for k, v in emulated_candidates(self.candidates).items()])
                excluded.update({k: v for k, v in (f.split("\n", 1) for f in found) if k not in excluded})
            op_report = op_timing_skipped(run_steps, models) if op_policy else ""  # short run, or recomputes
            op_seconds = 0.0
            uniform = len(names) == len(by_name) and not any(":" in n for n in names)  # no policy raced yet
            if op_policy and not op_report and _POLICY_BASE not in excluded and uniform:
                with self._selecting(by_name[_POLICY_BASE]):  # its forward is not the step that settles (pending)
                    report = measure_op_kinds(loss_fn, self.device, _POLICY_BASE, budget_s=op_timing_budget(run_steps))
                op_report, policy = report.explain(), policy_candidate(report, self.device)
                op_seconds = report.elapsed_s
                if policy is not None:
                    self._add_candidate(policy)
                    names = [p.name for p in self.candidates]  # safest first: fp32, the policy, bf16, ...
                    by_name[policy.name], scales[policy.name] = policy, 1.0
                    if dominated := report.base_dominated():  # the policy beats its base by far: one race less
                        excluded.setdefault(_POLICY_BASE, dominated)
            fp32_weights = all(p.param_dtype == torch.float32 for p in self.candidates)  # any may take a step
            in_run, rounds = in_run_plan(steps_left, len(names), rounds, in_run, fp32_weights, quiet_steps)
            race = dict(
                device=self.device.type,
                threads=torch.get_num_threads(),
                rounds=rounds,
                clock_name=clock_name,
                agree=self._agree,
                excluded=excluded,
                run_steps=steps_left if in_run else run_steps,
            )

            def finish(decision: AutoDecision) -> Precision:
                if stale:
                    decision = dataclasses.replace(decision, checked=stale)
                if op_report:
                    decision = dataclasses.replace(decision, op_timing=op_report, op_timing_seconds=op_seconds)
                if not self._is_main:
                    decision = decision.with_source("main process")
                if use_cache and decision.source == "measured":
                    auto_cache.store(key, decision)
                self.adopt(decision)
                return self.resolved

            if in_run:
                measured = "the run's own training steps (forward, backward and optimizer step, each in one mode)"
                steps = decide_steps(names, in_run=True, measured=measured, **race)
                race_steps = InRunRace(steps, clock, self.device, alone=alone)
                params = lambda: (p for _, p in self._param_names)  # noqa: E731
                self._in_run = RaceSteps(race_steps, self.candidates, params, self._optimizers, finish)
                return None
            finish(decide(names, run, clock=clock, **race))
        return self.decision

    def adopt(self, decision: AutoDecision) -> None:
        """Run as ``decision.chosen`` from now on (a resumed run's recorded decision, or the race's)."""
        self._add_candidate(recorded_policy(decision.chosen, [p.name for p in self.candidates], self.device))
        by_name = {p.name: p for p in self.candidates}
        if decision.chosen not in by_name:  # left out by this run (step_in_backward), or not raced on this device
            why = self._left_out.get(decision.chosen) or f"not a candidate on {self.device} ({', '.join(by_name)})"
            raise ValueError(
                f"precision='auto': the recorded decision {decision.chosen!r} cannot run here ({why}); resume "
                f"with precision={decision.chosen!r} and the settings and device that run it, or start a new run"
            )
        if self._compile_asked and self.cache_key and not decision.compile:  # what compiling it cost before
            decision = auto_cache.with_cached_compile(self.cache_key, decision)
        self._chosen, self.decision = by_name[decision.chosen], decision
        self._chosen.reason = decision.explain()
        self._in_run = self._trying = None  # a resume's decision ends a race running as the steps
        self.announce()  # the run's line again, now with the decision

    def note_compile(self, figures: CompileFigures) -> None:
        """This run's compile verdict (trainer/compile_gate.py) joins the decision, its reason and the cache."""
        if self.decision is not None and self._chosen is not None:
            self.decision = dataclasses.replace(self.decision, compile=figures.to_dict())
            self._chosen.reason = self.decision.explain()
            if self.cache_key and self._is_main and figures.source == "measured" and figures.compile_s is not None:
                auto_cache.store_compile(self.cache_key, self._chosen.name, figures.to_dict())  # the next run's

    def note_replay(self, steps: int, seconds: float) -> None:
        """The race's ``steps`` were taken again in the chosen mode (the Trainer's rewind): say so, and count them."""
        if self.decision is not None and self._chosen is not None:
            self.decision = self.decision.with_replay(steps, seconds)
            self._chosen.reason = self.decision.explain()

    def adopt_recorded(self, saved_name: str, record: Mapping[str, Any] | None) -> None:
        """At resume: keep the decision the checkpoint recorded (no measuring), or the precision it ran."""
        if self.decision is not None:
            return super().adopt_recorded(saved_name, record)
        if (not record and saved_name == self.name) or (record or {}).get("source") == "guess":
            return  # saved while its race ran as the steps, or unraced (a run too short): this one decides afresh
        if record:
            self.adopt(AutoDecision.from_dict(dict(record)).with_source("checkpoint"))
        else:
            measured = f"the checkpoint's precision ({saved_name})"
            self.adopt(AutoDecision(saved_name, {}, device=self.device.type, source="checkpoint", measured=measured))

    @contextlib.contextmanager
    def _selecting(self, precision: Precision) -> Iterator[None]:
        self._trying = precision
        try:
            yield
        finally:
            self._trying = None

    def __repr__(self) -> str:
        return f"AutoPrecision(candidates={[p.name for p in self.candidates]}, chosen={self.name!r})"
