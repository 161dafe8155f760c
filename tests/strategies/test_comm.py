"""Gradient communication precision (mixprec/strategies/comm.py): names, wiring, and the overflow safeguard.

In process, on a one-process gloo group (``distributed="ddp"``): DDP runs its communication hook there too,
so the cast, the all-reduce and the copy back are the real ones. Two processes: tests/strategies/test_distributed.py
(parity with the fp32 all-reduce, and the overflow on one rank skipping the step on both).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mixprec import Accelerator
from mixprec.strategies.comm import CommPrecision, make_comm
from mixprec.trainer.args import TrainingArguments

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")


@pytest.mark.parametrize(
    ("given", "name", "dtype"),
    [
        (None, "fp32", torch.float32),
        ("no", "fp32", torch.float32),
        ("bf16", "bf16", torch.bfloat16),
        ("bfloat16", "bf16", torch.bfloat16),
        ("FP16", "fp16", torch.float16),
        (CommPrecision("bf16"), "bf16", torch.bfloat16),
    ],
)
def test_names_are_parsed_in_one_place(given, name: str, dtype: torch.dtype) -> None:
    comm = make_comm(given)
    assert (comm.name, comm.wire_dtype) == (name, dtype)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Accelerator(cpu=True, comm_dtype="fp17", verbose=False), "Accelerator(comm_dtype=...): unknown"),
        (lambda: TrainingArguments("out", comm_dtype="int8"), "TrainingArguments(comm_dtype='int8'): unknown"),
        (lambda: make_comm("powersgd"), "not offered"),
    ],
)
def test_a_bad_name_is_one_line_naming_the_argument_and_the_choices(make, needle: str) -> None:
    with pytest.raises(ValueError, match="choose one of: fp32, bf16, fp16") as info:
        make()
    assert needle in str(info.value) and "\n" not in str(info.value)


class Gain(torch.nn.Module):
    """y = sum(x * w): elementwise, so autocast leaves it in fp32 and its gradient is fp32 up to the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def _one_step(precision: str, comm: str, factor: float) -> tuple[Accelerator, Gain]:
    acc = Accelerator(cpu=True, distributed="ddp", mixed_precision=precision, comm_dtype=comm, verbose=False)
    model = Gain()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    try:
        acc.backward(model(torch.linspace(1.0, 2.0, 8)) * factor)
        optimizer.step()
        optimizer.zero_grad()
    finally:
        acc.end_training()
    return acc, model


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_an_overflow_on_the_fp16_wire_is_a_skipped_step_never_a_silent_inf(precision: str) -> None:
    # Planted: gradients of 1e5..2e5 (fp16 precision: 10 x the 65536 loss scale; fp32: x 1e5) are finite in
    # fp32 and beyond fp16's 65504 on the wire. fp16's scaler, or fp32's non-finite guard, finds the inf the
    # all-reduce brought back and skips the step; the weights never see it. The fp32 wire, same gradients, steps.
    factor = 10.0 if precision == "fp16" else 1e5
    acc, model = _one_step(precision, "fp16", factor)
    assert acc.optimizer_step_was_skipped
    assert torch.equal(model.w.detach(), torch.ones(8))
    if precision == "fp16":
        assert acc.scaler.get_scale() == 32768.0  # backed off, as for an overflow in the backward
    acc, model = _one_step(precision, "fp32", factor)
    assert not acc.optimizer_step_was_skipped and not torch.equal(model.w.detach(), torch.ones(8))


def test_bf16_on_the_wire_rounds_gradients_to_bf16_and_keeps_fp32_range() -> None:
    # The same planted gradient goes through bf16 (fp32's exponent range): the step is taken, with each gradient
    # rounded to bf16's 8 bits (relative error <= 2^-8), and the optimizer still holds fp32 gradients.
    acc = Accelerator(cpu=True, distributed="ddp", comm_dtype="bf16", verbose=False)
    model = acc.prepare(Gain())
    try:
        x = torch.linspace(1.0, 2.0, 8) * 1e5 + 1.0 / 3.0
        acc.backward(model(x))
        grad = model.w.grad
    finally:
        acc.end_training()
    assert grad.dtype == torch.float32 and bool(grad.isfinite().all())
    assert torch.equal(grad, x.to(torch.bfloat16).float())  # what bf16 makes of it, exactly
    assert not torch.equal(grad, x)


def test_bf16_and_fp16_on_the_wire_halve_the_bytes_all_reduced_per_step() -> None:
    # What `mixprec bench --nproc-per-node N` reports, measured the same way (the backend's collectives in one
    # profiled step): fp32 hands gloo every gradient's 4 bytes, bf16 and fp16 2.
    from mixprec.bench.comm_bench import bytes_all_reduced

    measured = {}
    for comm in ("fp32", "bf16", "fp16"):
        acc = Accelerator(cpu=True, distributed="ddp", comm_dtype=comm, verbose=False)
        model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))
        try:
            step = lambda model=model, acc=acc: acc.backward(model(torch.randn(3, 16)).sum())  # noqa: E731
            measured[comm] = bytes_all_reduced(step)
        finally:
            acc.end_training()
    elements = 16 * 32 + 32 + 32 * 4 + 4
    assert measured == {"fp32": 4 * elements, "bf16": 2 * elements, "fp16": 2 * elements}


def test_the_wire_dtype_is_described_for_the_run_header_and_summary() -> None:
    # issue 34: --comm-dtype was recorded in config files only; header and summary show it beside the precision
    assert make_comm("bf16").describe(2) == "gradients travel in bf16"
    assert make_comm(None).describe(4) == "gradients travel in fp32"
    assert make_comm("fp16").describe(1) == "comm_dtype fp16 unused (one process: no gradients travel)"
    assert make_comm(None).describe(1) == ""  # one process, the default: nothing to say
