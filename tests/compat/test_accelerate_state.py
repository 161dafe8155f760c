"""accelerate's process-wide state after only mixprec's Accelerator (issue 22): ``accelerate.logging``,
``PartialState()``, ``GradientState()`` and ``accelerate.utils`` helpers read it, in one process and under
torchrun; without accelerate the Accelerator neither needs nor imports it."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import Accelerator

accelerate_state = pytest.importorskip("accelerate.state")
WORKER = Path(__file__).with_name("accelerate_state_worker.py")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    accelerate_state.AcceleratorState._reset_state(True)
    accelerate_state.GradientState._reset_state()
    yield
    accelerate_state.AcceleratorState._reset_state(True)
    accelerate_state.GradientState._reset_state()


def test_accelerate_logging_works_after_our_accelerator(caplog):
    from accelerate.logging import get_logger

    Accelerator(verbose=False)
    logger = get_logger("a_script")
    with caplog.at_level(logging.INFO, logger="a_script"):
        logger.info("hello")  # raised "You must initialize the accelerate state" before
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] hello"]  # accelerate's prefix


def test_partial_state_agrees_with_ours_and_accelerates_own_accelerator_still_chooses_its_precision():
    acc = Accelerator(mixed_precision="fp16", verbose=False)
    state = accelerate_state.PartialState()
    assert (state.process_index, state.num_processes, state.device) == (0, 1, acc.device)
    assert state.is_main_process and state.is_local_main_process
    # accelerate fixes the precision once per process: left to its own Accelerator (HF's Trainer, made later).
    from accelerate import Accelerator as AccelerateAccelerator

    assert AccelerateAccelerator(mixed_precision="bf16").mixed_precision == "bf16"


def test_gradient_state_follows_what_a_script_sets():
    acc = Accelerator(gradient_accumulation_steps=2, verbose=False)
    state = accelerate_state.GradientState()
    assert state.num_steps == 2
    acc.gradient_accumulation_steps = 4
    acc.sync_gradients = False
    assert (state.num_steps, state.sync_gradients) == (4, False)


def test_without_accelerate_nothing_is_imported_and_training_runs(monkeypatch):
    for name in [m for m in sys.modules if m == "accelerate" or m.startswith("accelerate.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # what a missing package looks like to import
    acc = Accelerator(verbose=False)
    model, opt = acc.prepare(torch.nn.Linear(3, 1), torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=0.1))
    acc.backward(model(torch.ones(2, 3)).sum())
    acc.gradient_accumulation_steps = 3
    assert not any(m.startswith("accelerate.") for m in sys.modules)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_under_torchrun_accelerate_reads_the_group_mixprec_joined(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}"]
    proc = subprocess.run([*cmd, str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for i, got in enumerate(ranks):
        assert (got["process_index"], got["num_processes"], got["local_process_index"]) == (i, 2, i)
        assert got["is_main_process"] is (i == 0)
        assert got["mixprec"][:2] == [i, 2]
        assert got["mixprec"][2] == got["device"].split(":")[0]  # accelerate says "cpu:0" for a CPU process
        assert got["gathered"] == [0.0, 1.0]
        assert got["cache_seen"] is True and got["parallel_mode"] == "distributed"  # main_process_first
        assert got["ddp"] == [15, True, True]  # DistributedDataParallelKwargs' two settings, the rest DDP's defaults
    out = proc.stdout + proc.stderr
    assert out.count("from the main process only") == 1 and out.count("from every process") == 2
