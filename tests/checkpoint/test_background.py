"""Asynchronous saves and the training thread (mixprec/checkpoint/staging.py, background.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The suite runs with one OpenMP thread (conftest), where no thread team is ever made: a process with two, as
# `mixprec train` on two cores. Native threads that Python does not know of are OpenMP's workers.
_SCRIPT = """
import json, os, sys, threading, torch
from mixprec import Accelerator

def native():
    return len(os.listdir("/proc/self/task")) - threading.active_count()

torch.set_num_threads(2)
acc = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = acc.prepare(model, optimizer)
model(torch.randn(64, 512)).sum().backward()
optimizer.step()
before = native()
acc.save_state(sys.argv[1], async_save=True)
acc.wait_for_checkpoint()
print(json.dumps({"before": before, "after": native(), "threads": torch.get_num_threads()}))
"""


def test_an_async_save_gives_its_writer_no_openmp_team(tmp_path):
    # a writer thread that ran a parallel op got OpenMP workers of its own, and with more OpenMP threads than
    # cores every later op of the training thread paid a wake-up (the main job's forward took 1.5x as long
    # after its first save): the writer copies on one thread, and the caller keeps its two
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    script = [sys.executable, "-c", _SCRIPT, str(tmp_path / "ck")]
    done = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.splitlines()[-1])
    assert counts["after"] == counts["before"]
    assert counts["threads"] == 2
    assert (tmp_path / "ck").is_dir()
