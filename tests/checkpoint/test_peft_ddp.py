"""A peft model's checkpoints hold its adapters only (checkpoint/model_part.py), under DDP and FSDP2 alike, and
load on every process: the Trainer's resume and ``load_best_model_at_end``, under torchrun with 2 processes
(peft_ddp_worker.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"),
]

WORKER = Path(__file__).with_name("peft_ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_every_process_loads_a_peft_checkpoint_of_adapters_resume_and_best_model(
    tmp_path: Path, distributed: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={port}", str(WORKER), str(tmp_path), distributed]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    # the checkpoints hold the adapters (FSDP2's too: its wrapper class is no peft class, its base is), and the
    # Trainer's resume from checkpoint-2 trains on to checkpoint-4's adapters, on both processes
    assert [r["resumed_exactly"] for r in ranks] == [True, True]
    # load_best_model_at_end gives both processes the best checkpoint's adapters over the frozen base
    assert ranks[0]["best"] == ranks[1]["best"] == "checkpoint-2"  # not the last: the model changes at the end
    assert [r["best_loaded"] for r in ranks] == [True, True]
