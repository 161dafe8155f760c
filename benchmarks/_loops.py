"""The training loops that ``benchmarks.compare_loops`` races, each driving its own copy of the same model.

Every loop does the same work per step: fetch a batch from a DataLoader over the same dataset, forward
under the precision, backward (with loss scaling where the loop does it), clip the gradient norm to
``max_grad_norm``, AdamW step, zero the gradients. What differs is only who writes that code: you (by hand,
with torch.amp), mixprec (GradScaler, Accelerator, Trainer) or Hugging Face (Accelerate, Trainer).

A loop is exposed as a :class:`Stepper`: ``steps(n)`` runs exactly n more steps and returns. Hand-written
loops are generators; the two Trainers own their loop, so each runs in a worker thread that a callback
parks at a step boundary until the next ``steps(n)`` (the GIL and the parking mean only one loop ever runs
at a time). That is what lets Trainers take part in interleaved rounds like everything else.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

import mixprec
from mixprec.models import GPT

_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_HF_NAMES = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}


@dataclass
class Setup:
    """The shared work: model shape and initial weights, data, optimiser settings, precision, device."""

    model_name: str
    init_state: dict[str, torch.Tensor]
    dataset: Dataset
    precision: str
    batch_size: int
    lr: float
    max_grad_norm: float
    seed: int
    device: torch.device

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.precision]

    def fresh_model(self) -> GPT:
        model = GPT.from_preset(self.model_name)
        model.load_state_dict(self.init_state)
        return model.to(self.device).train()

    def loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=g, drop_last=True)

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless batches on the device, epoch after epoch, as a hand-written loop fetches them."""
        for batch in itertools.chain.from_iterable(self.loader() for _ in itertools.count()):
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


class DtypeObserver:
    """Forward hooks on every Linear that record the dtype it computed in: what the loop *actually* ran,
    whatever it was asked for. Removed before timing (hooks cost a little per call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: set[str] = set()
        self._handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def _hook(self, _module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
        self.seen.add(str(output.dtype).removeprefix("torch."))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class Stepper:
    """A running loop: ``steps(n)`` advances it by exactly n optimizer steps."""

    def __init__(self, name: str, observer: DtypeObserver) -> None:
        self.name, self.observer = name, observer

    def steps(self, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.observer.remove()


class GeneratorStepper(Stepper):
    def __init__(self, name: str, observer: DtypeObserver, gen: Iterator[None]) -> None:
        super().__init__(name, observer)
        self._gen = gen

    def steps(self, n: int) -> None:
        for _ in range(n):
            next(self._gen)

    def close(self) -> None:
        super().close()
        self._gen.close()


class _Gate:
    """Parks a Trainer's thread at a step boundary until the main thread grants more steps."""

    def __init__(self) -> None:
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.count, self.target = 0, 0
        self.error: BaseException | None = None
        self.finished = False

    def train_begin(self) -> None:
        self.go.acquire()

    def step_end(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.done.release()
            self.go.acquire()


class ThreadStepper(Stepper):
    def __init__(self, name: str, observer: DtypeObserver, train: Callable[[], object], gate: _Gate, tmp: str):
        super().__init__(name, observer)
        self._gate, self._tmp = gate, tmp
        self._thread = threading.Thread(target=self._work, args=(train,), name=name, daemon=True)
        self._thread.start()

    def _work(self, train: Callable[[], object]) -> None:
        try:
            train()
        except BaseException as exc:  # handed to the main thread, which re-raises it
            self._gate.error = exc
        finally:
            self._gate.finished = True
            self._gate.done.release()

    def steps(self, n: int) -> None:
        gate = self._gate
        gate.target = gate.count + n
        gate.go.release()
        gate.done.acquire()
        if gate.error is not None:
            raise RuntimeError(f"{self.name} failed in its training thread: {gate.error!r}") from gate.error
        if gate.finished and gate.count < gate.target:
            raise RuntimeError(f"{self.name} stopped after {gate.count} steps, {gate.target} were asked for")

    def close(self) -> None:
        super().close()
        self._gate.target = float("inf")
        self._gate.go.release()
        self._thread.join(timeout=60)
        shutil.rmtree(self._tmp, ignore_errors=True)


# -- the hand-written loops -------------------------------------------------------------------------------


def _clip(model: torch.nn.Module, s: Setup) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)


def torch_amp_loop(s: Setup, model: torch.nn.Module) -> Iterator[None]:
    """The floor: torch.autocast + torch.amp.GradScaler, as the PyTorch AMP recipe writes it."""
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    scaler = torch.amp.GradScaler(s.device.type, enabled=s.precision == "fp16")
    enabled, dtype = s.dtype is not None, s.dtype or torch.bfloat16  # dtype is ignored when disabled
    for batch in s.batches():
        with torch.autocast(s.device.type, dtype=dtype, enabled=enabled):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        _clip(model, s)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        yield


def no_scaling_loop(s: Setup, model: torch.nn.Module) -> Iterator[None]:
    """The same step with no loss scaler at all (for the cost of scaling; fp16 gradients may underflow)."""
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    enabled, dtype = s.dtype is not None, s.dtype or torch.bfloat16
    for batch in s.batches():
        with torch.autocast(s.device.type, dtype=dtype, enabled=enabled):
            loss = model(**batch).loss
        loss.backward()
        _clip(model, s)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def mixprec_scaler_loop(s: Setup, model: torch.nn.Module) -> Iterator[None]:
    """The floor's loop with mixprec's strategy and GradScaler in place of torch's."""
    precision = mixprec.resolve_precision(s.precision, s.device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    scaler = precision.make_scaler()
    for batch in s.batches():
        with precision.autocast():
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        _clip(model, s)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        yield


def _accelerator_loop(acc: object, s: Setup, model: torch.nn.Module) -> Iterator[None]:
    """The seed's Accelerator snippet; the same code drives mixprec's and Hugging Face's."""
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=s.lr), s.loader())
    for batch in itertools.chain.from_iterable(loader for _ in itertools.count()):
        loss = model(**batch).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), s.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def mixprec_accelerator_loop(s: Setup, model: torch.nn.Module) -> Iterator[None]:
    acc = mixprec.Accelerator(mixed_precision=s.precision, cpu=s.device.type == "cpu", verbose=False)
    yield from _accelerator_loop(acc, s, model)


def hf_accelerate_loop(s: Setup, model: torch.nn.Module) -> Iterator[None]:
    import accelerate

    acc = accelerate.Accelerator(mixed_precision=_HF_NAMES[s.precision], cpu=s.device.type == "cpu")
    yield from _accelerator_loop(acc, s, model)


# -- the Trainers ---------------------------------------------------------------------------------------


def mixprec_trainer(
    s: Setup, model: torch.nn.Module, max_steps: int, gate: _Gate, tmp: str, **overrides: object
) -> Callable[[], object]:
    """mixprec's Trainer over ``s`` (no logging, evaluation or saves unless ``overrides`` of TrainingArguments
    say otherwise), parked by ``gate`` at each step's end; returns its ``train``."""

    class Park(mixprec.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            gate.train_begin()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            gate.step_end()

    args = mixprec.TrainingArguments(
        output_dir=tmp,
        precision=s.precision,
        max_steps=max_steps,
        per_device_train_batch_size=s.batch_size,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        max_grad_norm=s.max_grad_norm,
        seed=s.seed,
        save_strategy="no",
        disable_tqdm=True,
        save_plots=False,
        report_to="none",
        use_cpu=s.device.type == "cpu",
        **{"logging_strategy": "no", **overrides},
    )
    return mixprec.Trainer(model=model, args=args, train_dataset=s.dataset, callbacks=[Park()]).train


def _hf_trainer(s: Setup, model: torch.nn.Module, max_steps: int, gate: _Gate, tmp: str) -> Callable[[], object]:
    import transformers

    class Park(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            gate.train_begin()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            gate.step_end()

    args = transformers.TrainingArguments(
        output_dir=tmp,
        fp16=s.precision == "fp16",
        bf16=s.precision == "bf16",
        max_steps=max_steps,
        per_device_train_batch_size=s.batch_size,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        max_grad_norm=s.max_grad_norm,
        seed=s.seed,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        report_to=[],
        use_cpu=s.device.type == "cpu",
        optim="adamw_torch",
        dataloader_num_workers=0,
        weight_decay=0.0,
    )

    class Trainer(transformers.Trainer):
        # HF counts FLOPs every step via model.num_parameters(exclude_embeddings=True), HF's signature; the
        # built-in GPT spells it exclude_position_embeddings and raises TypeError otherwise. Same work here.
        def floating_point_ops(self, inputs):  # noqa: ANN001
            return 6 * inputs["input_ids"].numel() * self.model.num_parameters(exclude_position_embeddings=True)

    trainer = Trainer(model=model, args=args, train_dataset=s.dataset, callbacks=[Park()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its end-of-run dict went to stdout
    return trainer.train


LOOPS: dict[str, Callable[[Setup, torch.nn.Module], Iterator[None]]] = {
    "torch.amp by hand": torch_amp_loop,
    "no loss scaling": no_scaling_loop,
    "mixprec GradScaler": mixprec_scaler_loop,
    "mixprec Accelerator": mixprec_accelerator_loop,
    "HF Accelerate": hf_accelerate_loop,
}
TRAINERS = {"mixprec Trainer": mixprec_trainer, "HF Trainer": _hf_trainer}
VARIANTS = [*LOOPS, *TRAINERS]
FLOOR = "torch.amp by hand"
NEEDS = {"HF Accelerate": "accelerate", "HF Trainer": "transformers"}


def start(name: str, s: Setup, max_steps: int) -> Stepper:
    """Build variant ``name`` on a fresh copy of the model, ready to run ``max_steps`` steps in all."""
    model = s.fresh_model()
    observer = DtypeObserver(model)
    if name in LOOPS:
        return GeneratorStepper(name, observer, LOOPS[name](s, model))
    gate, tmp = _Gate(), tempfile.mkdtemp(prefix="compare_loops_")
    return ThreadStepper(name, observer, TRAINERS[name](s, model, max_steps, gate, tmp), gate, tmp)
