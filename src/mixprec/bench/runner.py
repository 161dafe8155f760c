"""Run one workload under several precisions, interleaved, in one process, and measure each.

The protocol (STYLE.md habit 13):

1. resolve every precision name once ("auto" through the same registry as everything else, then decided
   as in training: raced on this workload's first training step; a mode the device cannot run becomes a
   row saying why, never a silent fp32 run);
2. measure the matmul peak of each compute dtype (for MFU);
3. give each distinct mode a fresh deep copy of the same initial model, its own AdamW and its own
   ``precision.make_scaler()`` (loss scaling for fp16, the pass-through scaler otherwise): the loop is
   the one every mixprec user writes, with no branch on the mode;
4. warm up every mode, then run ``rounds`` rounds of ``steps`` timed steps each, rotating which mode goes
   first, so slow drift and noisy neighbours spread over all modes;
5. score the held-out batch, then measure each mode's peak memory on a fresh copy, one mode at a time,
   after timing (so it cannot disturb it) and after warm-up (so one-time costs are not counted).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mixprec.bench.bench_config import BenchConfig
from mixprec.bench.footprint import training_state_bytes
from mixprec.bench.memory import MemoryMeasurement, measure_run
from mixprec.bench.peak import PeakFlops, measure_peak_flops
from mixprec.bench.result import BenchResult, PrecisionResult
from mixprec.bench.timing import make_timer, summarize, synchronize
from mixprec.bench.workload import Batch, Workload
from mixprec.precision.base import Precision, PrecisionNotSupportedError, default_device
from mixprec.precision.registry import canonical_name, make_precision, resolve_precision
from mixprec.scaling.scaler import GradScaler

Log = Callable[[str], None]


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a model output: ``.loss`` (HF ModelOutput, the built-in GPT), ``["loss"]`` or ``[0]``."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if not isinstance(loss, torch.Tensor):
        raise ValueError("the model returned no loss: call it with labels (model(**batch) must give .loss)")
    return loss


def train_step(
    model: torch.nn.Module,
    batch: Batch,
    precision: Precision,
    optimizer: torch.optim.Optimizer,
    scaler: GradScaler,
) -> torch.Tensor:
    """One optimizer step, the same code for every precision. Returns the detached loss (no host sync;
    the scaler's ``step`` syncs once when loss scaling is on, to read its inf check)."""
    with precision.autocast():
        output = model(**batch)
    loss = loss_of(output)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@dataclass
class Arm:
    """One precision's private copy of everything that trains (in the DDP bench, one communication dtype's)."""

    precision: Precision
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: GradScaler
    times: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    """The timed steps' losses (detached)."""
    last_loss: torch.Tensor | None = None
    """The loss of the last step run, timed or not."""
    steps_done: int = 0


def _make_arm(workload: Workload, precision: Precision, lr: float) -> Arm:
    model = precision.convert_module(workload.fresh_model(precision.device))
    optimizer = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=lr))
    return Arm(precision, model, optimizer, precision.make_scaler())


def run_steps(arm: Arm, batches: list[Batch], n: int, *, timed: bool, shift: int = 0) -> None:
    """``n`` training steps of ``arm``, cycling through ``batches`` from ``shift`` on (a DDP process its own
    batch); ``timed``: each step timed, and the segment synchronised once at its end either way."""
    timer = make_timer(arm.precision.device)
    for _ in range(n):
        batch = batches[(arm.steps_done + shift) % len(batches)]
        if timed:
            timer.start()
        arm.last_loss = train_step(arm.model, batch, arm.precision, arm.optimizer, arm.scaler)
        if timed:
            timer.stop()
            arm.losses.append(arm.last_loss)
        arm.steps_done += 1
    if timed:
        arm.times.extend(timer.times())  # the one sync of the segment on CUDA
    else:
        synchronize(arm.precision.device)


@torch.no_grad()
def _eval_loss(arm: Arm, batch: Batch) -> float:
    arm.model.eval()
    with arm.precision.autocast():
        loss = loss_of(arm.model(**batch))
    arm.model.train()
    return float(loss.float())


def memory_run(workload: Workload, name: str, device: torch.device, steps: int, lr: float) -> Callable[[], None]:
    """The work whose peak memory is reported for precision ``name``: a fresh copy of the model and its
    optimizer, then ``steps`` training steps (the ``run`` that :func:`~mixprec.bench.memory.measure_run` measures)."""
    precision = resolve_precision(name, device)
    batches = [{k: v.to(device) for k, v in b.items()} for b in workload.batches]

    def run() -> None:
        arm = _make_arm(workload, precision, lr)
        run_steps(arm, batches, steps, timed=False)

    return run


def _measure_memory(workload: Workload, name: str, device: torch.device, cfg: BenchConfig) -> MemoryMeasurement | str:
    measured = measure_run(lambda: memory_run(workload, name, device, cfg.memory_steps, cfg.lr), device)
    if measured is None:
        return f"not measured: no resettable peak-memory counter for {device.type} on this OS"
    return measured


def _resolve_all(
    names: tuple[str, ...], device: torch.device, decide_auto: Callable[[Precision], Precision]
) -> list[tuple[str, Precision | None, str, bool]]:
    """(name as asked, canonical; its strategy, or None and why the device cannot run it; whether "auto" chose
    it: a strategy to be decided on the training step, decided here by ``decide_auto``)."""
    out: list[tuple[str, Precision | None, str, bool]] = []
    for name in names:
        canon = canonical_name(name)
        try:
            p = make_precision(canon, device)
            by_auto = p.pending
            out.append((canon, decide_auto(p) if by_auto else p, "", by_auto))
        except PrecisionNotSupportedError as exc:
            out.append((canon, None, str(exc), False))
    return out


def race_auto(workload: Workload, auto: Precision, batch: Batch, lr: float) -> Precision:
    """Decide "auto" as the Trainer does: race its candidates on this workload's training step (a fresh copy
    of the model, its first batch), never from a cache (the bench is there to measure)."""
    model = workload.fresh_model(auto.device)
    torch.optim.AdamW(model.parameters(), lr=lr)  # the optimizer is the same in every autocast mode: not raced

    def loss_fn() -> torch.Tensor:
        with auto.autocast():  # the candidate on trial's autocast
            return loss_of(model(**batch))

    auto.settle(loss_fn, [model], batch=batch, use_cache=False)
    return auto.resolved


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run_bench(
    workload: Workload,
    config: BenchConfig | None = None,
    *,
    device: torch.device | str | None = None,
    log: Log | None = None,
) -> BenchResult:
    """Benchmark ``workload`` under ``config.precisions`` on ``device`` (default: CUDA if present, else CPU).

    Progress goes to ``log`` (one line per phase). Synchronises the device between timed segments, never
    inside one (CUDA events).
    """
    cfg = config or BenchConfig()
    dev = torch.device(device) if device is not None else default_device()
    say = log or (lambda _msg: None)
    started = time.perf_counter()
    batches = [{k: v.to(dev) for k, v in b.items()} for b in workload.batches]
    eval_batch = {k: v.to(dev) for k, v in workload.eval_batch.items()}
    decisions: list[dict[str, Any]] = []
    first = batches[0]

    def decide_auto(auto: Precision) -> Precision:
        say("auto: racing the candidate modes on the first batch's training step")
        chosen = race_auto(workload, auto, first, cfg.lr)
        decisions.append(auto.decision_record() or {})
        return chosen

    resolved = _resolve_all(cfg.precisions, dev, decide_auto)
    # "auto" shares the run of the mode it picked (one arm per distinct mode): same code, same numbers,
    # so it cannot look faster or slower than its twin by noise alone
    arms_by_mode: dict[str, Precision] = {}
    for name, p, _, by_auto in resolved:
        if p is not None:
            arms_by_mode.setdefault(p.name, p)
            if by_auto:
                say(f"{name} -> {p.name}: {p.reason}")
    asked = {name for name, _, _, by_auto in resolved if not by_auto}

    peaks: dict[str, PeakFlops] = {}
    if cfg.measure_peak:
        for p in arms_by_mode.values():
            key = str(p.matmul_dtype)  # a policy that keeps linear in fp32 runs its FLOPs at fp32's peak
            if key not in peaks:
                peaks[key] = measure_peak_flops(p.matmul_dtype, dev)
                say(f"peak {peaks[key].source}")

    arms = {mode: _make_arm(workload, p, cfg.lr) for mode, p in arms_by_mode.items()}
    order = list(arms)
    if cfg.warmup:
        say(f"warm-up: {cfg.warmup} step(s) each of {', '.join(order)}")
        for mode in order:
            run_steps(arms[mode], batches, cfg.warmup, timed=False)
    for r in range(cfg.rounds if order else 0):  # every mode asked for may be one this machine cannot run
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for mode in rotated:
            gc.collect()  # collect between segments, not during one
            run_steps(arms[mode], batches, cfg.steps, timed=True)
        done = ", ".join(f"{m} {summarize(arms[m].times).median * 1e3:.1f} ms" for m in order)
        say(f"round {r + 1}/{cfg.rounds}: median step so far: {done}")

    rows: list[PrecisionResult] = []
    for name, p, why, by_auto in resolved:
        if p is None:
            rows.append(PrecisionResult(name, name, "", "", workload.tokens_per_step, skipped=why))
            continue
        arm = arms[p.name]
        last = arm.losses[-cfg.steps :]
        shared = p.name if by_auto and p.name in asked else None
        rows.append(
            PrecisionResult(
                precision=name,
                resolved=p.name,
                reason=p.reason,
                compute_dtype=str(p.compute_dtype).removeprefix("torch."),
                tokens_per_step=workload.tokens_per_step,
                times=summarize(arm.times),
                loss=_eval_loss(arm, eval_batch),
                train_loss=float(torch.stack(last).float().mean()),
                skipped_steps=arm.scaler.record.skipped_steps,
                final_scale=arm.scaler.get_scale(),
                peak=peaks.get(str(p.matmul_dtype)),
                flops_per_token=workload.flops_per_token,
                shares_measurement_with=shared,
                chosen_by_auto=by_auto,
                bytes_per_param=training_state_bytes(arm.model, arm.optimizer)["per_param"],
            )
        )
    del arms, batches
    gc.collect()

    if cfg.measure_memory:
        measured: dict[str, MemoryMeasurement | str] = {}
        for mode in arms_by_mode:
            say(f"peak memory of {mode} ({cfg.memory_steps} steps)")
            measured[mode] = _measure_memory(workload, mode, dev, cfg)
        for row in rows:
            m = measured.get(row.resolved)
            if isinstance(m, MemoryMeasurement):
                row.peak_mem_bytes, row.peak_mem_source = m.peak_bytes, m.source
            elif isinstance(m, str):
                row.peak_mem_source = m

    return BenchResult(
        device=dev.type,
        device_name=_device_name(dev),
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        workload=workload.description,
        config=asdict(cfg),
        rows=rows,
        flops_source=workload.flops_source,
        wall_seconds=time.perf_counter() - started,
        auto_race=decisions[0] if decisions else None,
    )
