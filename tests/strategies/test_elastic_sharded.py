"""Sharded FSDP2 checkpoints (torch.distributed.checkpoint): saved by 2 processes and loaded by 1, the reverse,
and exported to one safetensors file; every round trip gives identical parameters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.checkpoint import CheckpointError, load_tensors
from mixprec.checkpoint.sharded import check_sharded, export_safetensors
from mixprec.cli.main import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("sharded_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run_worker(processes: int, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    if processes == 1:
        cmd = [sys.executable, str(WORKER), *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(WORKER),
            *args,
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def assert_identical(a: Path, b: Path) -> None:
    x, y = load_tensors(a), load_tensors(b)
    assert x.keys() == y.keys()
    for name in x:
        assert torch.equal(x[name], y[name]), name


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 1), (1, 2)])
def test_a_sharded_checkpoint_loads_with_another_number_of_processes(
    tmp_path: Path, saved_by: int, loaded_by: int
) -> None:
    run_worker(saved_by, "save", str(tmp_path / "saved"))
    assert len(list((tmp_path / "saved" / "sharded").glob("*.distcp"))) == saved_by  # one shard per process
    check_sharded(tmp_path / "saved" / "sharded")
    run_worker(loaded_by, "load", str(tmp_path), str(tmp_path / "saved"))
    assert_identical(tmp_path / "loaded.safetensors", tmp_path / "saved" / "full.safetensors")
    # ... and one safetensors file for inference, without any process group
    export_safetensors(tmp_path / "saved" / "sharded", tmp_path / "export.safetensors")
    assert_identical(tmp_path / "export.safetensors", tmp_path / "saved" / "full.safetensors")
    # a damaged shard is refused by name, before anything is loaded
    shard = next((tmp_path / "saved" / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=shard.name):
        export_safetensors(tmp_path / "saved" / "sharded", tmp_path / "bad.safetensors")


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 1), (1, 2)])
def test_a_sharded_save_state_loads_weights_and_optimizer_exactly_with_another_number_of_processes(
    tmp_path: Path, saved_by: int, loaded_by: int
) -> None:
    run_worker(saved_by, "state-save", str(tmp_path / "saved"))
    state = tmp_path / "saved" / "state"
    shards = sorted(p.name for p in (state / "model_0.dcp").glob("*.distcp"))
    assert len(shards) == saved_by and not (state / "model.safetensors").exists()  # each process wrote its part
    assert (state / "optimizer_0.dcp" / ".metadata").is_file() and (state / "manifest.json").is_file()
    run_worker(loaded_by, "state-load", str(tmp_path / "loaded"), str(tmp_path / "saved"))
    assert_identical(tmp_path / "loaded" / "full.safetensors", tmp_path / "saved" / "full.safetensors")
    # `mixprec export CHECKPOINT model.safetensors`: one file of its model (model_0.dcp), as the guide says
    assert main(["export", str(state), str(tmp_path / "export.safetensors")]) == 0
    assert_identical(tmp_path / "export.safetensors", tmp_path / "saved" / "full.safetensors")
    saved = torch.load(tmp_path / "saved" / "optimizer.pt", weights_only=True)
    loaded = torch.load(tmp_path / "loaded" / "optimizer.pt", weights_only=True)
    assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
    for name, moments in saved["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(loaded["state"][name][key]), torch.as_tensor(value)), (name, key)
    # a damaged shard is refused by name (the checkpoint's manifest lists every process's shards)
    shard = state / "model_0.dcp" / shards[0]
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    with pytest.raises(CheckpointError, match=shards[0]):
        export_safetensors(state, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
