"""The Trainer under torchrun (2 processes, gloo, CPU): every process trains, the main one logs and saves."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"),
]

SCRIPT = Path(__file__).with_name("trainer_torchrun_script.py")
FSDP_SCRIPT = Path(__file__).with_name("trainer_fsdp_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("trainer-torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(SCRIPT),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out, [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def test_token_predictions_of_different_lengths_per_process_are_padded_and_gathered(run):
    # dynamic padding makes rank 0's sequences shorter than rank 1's: HF's Trainer pads them across processes
    # with -100 before gathering; every example comes back once, in order, its labels intact
    _, ranks = run
    for rank in ranks:
        ragged = rank["ragged"]
        assert ragged["predictions_shape"][:2] == [7, 6]
        assert [[t for t in row if t != -100] for row in ragged["labels"]] == ragged["expected_labels"]


def test_every_process_trains_to_identical_parameters(run):
    _, ranks = run
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 6  # 22 samples / (2 x 4) -> 3 steps x 2 epochs
    assert ranks[0]["params"] == ranks[1]["params"]


def test_the_logged_loss_is_the_runs_over_every_process_as_hfs(run):
    # each process logged its own micro-batches' mean: rank 0's log was half the batch, and the ranks disagreed
    _, ranks = run
    assert len(ranks[0]["losses"]) == 6 and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["train_loss"] == ranks[1]["train_loss"]


def test_only_the_main_process_logs_and_saves(run):
    out, ranks = run
    assert [r["writes_logs"] for r in ranks] == [True, False]
    entries = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [e["step"] for e in entries if "loss" in e]
    assert train_steps == [1, 2, 3, 4, 5, 6]  # one writer: no step logged twice
    assert sorted(p.name for p in (out / "run").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]
    assert {p.name for p in (out / "run" / "checkpoint-6").glob("rng_state_*.pt")} == {
        "rng_state_0.pt",
        "rng_state_1.pt",
    }


def test_evaluation_counts_every_example_once_and_agrees_across_processes(run):
    _, ranks = run

    def results(rank: dict) -> list[dict]:
        return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in rank["evals"]]

    assert results(ranks[0]) == results(ranks[1]) and len(results(ranks[0])) == 2
    # 7 validation examples split 4 + 3 and gathered: each exactly once
    assert [e["eval_examples"] for e in ranks[0]["evals"]] == [7.0, 7.0]


# -- FSDP2: the weights that leave the run are the full model's --------------------------------------------


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> Path:
    """trainer_fsdp_script.py under torchrun (FSDP2, 2 processes) and alone (1 process), side by side."""
    out = tmp_path_factory.mktemp("trainer-fsdp")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    two = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(FSDP_SCRIPT),
        str(out / "fsdp"),
    ]
    two_sharded = [*two[:4], f"--master_port={_free_port()}", str(FSDP_SCRIPT), str(out / "sharded")]
    runs = [
        (two, env),
        ([sys.executable, str(FSDP_SCRIPT), str(out / "single")], env),
        (two_sharded, {**env, "FSDP_STATE_DICT_TYPE": "sharded"}),
    ]
    procs = [
        subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd, e in runs
    ]
    for proc in procs:
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{proc.args}:\n{text[-3000:]}"
    # the sharded run again from its checkpoint-2 (a copy without checkpoint-3): a resume through the shards
    shutil.copytree(out / "sharded" / "run", out / "resumed" / "run")
    shutil.rmtree(out / "resumed" / "run" / "checkpoint-3")
    again = [*two[:4], f"--master_port={_free_port()}", str(FSDP_SCRIPT), str(out / "resumed")]
    proc = subprocess.run(
        again,
        env={**env, "FSDP_STATE_DICT_TYPE": "sharded", "RESUME": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def test_save_model_under_fsdp2_writes_the_full_weights_of_the_one_process_run(fsdp_runs):
    from mixprec.checkpoint import load_tensors

    ranks = [json.loads((fsdp_runs / "fsdp" / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["distributed"] for r in ranks] == ["FSDP", "FSDP"]
    assert [r["local_rows"] for r in ranks] == [8, 8]  # each process held half of the 16-row embedding
    sharded = load_tensors(fsdp_runs / "fsdp" / "saved" / "model.safetensors")
    alone = load_tensors(fsdp_runs / "single" / "saved" / "model.safetensors")
    assert sharded.keys() == alone.keys()  # the user's module's names, no wrapper prefixes
    for name, tensor in alone.items():
        assert sharded[name].shape == tensor.shape, name
        # fp32; only the order of the gradient reduction differs
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_load_best_model_at_end_under_fsdp2_loads_the_best_checkpoint(fsdp_runs):
    from mixprec.checkpoint import load_tensors

    run = fsdp_runs / "fsdp" / "run"
    ranks = [json.loads((fsdp_runs / "fsdp" / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["best_model_checkpoint"] for r in ranks] == [str(run / "checkpoint-2")] * 2
    saved = load_tensors(fsdp_runs / "fsdp" / "saved" / "model.safetensors")
    best = load_tensors(run / "checkpoint-2" / "model.safetensors")
    last = load_tensors(run / "checkpoint-3" / "model.safetensors")
    assert all(torch.equal(saved[name], best[name]) for name in best)  # the best step's weights, every shard
    assert not all(torch.equal(saved[name], last[name]) for name in last)  # not the last step's


def test_sharded_checkpoints_under_fsdp2_hold_each_processs_part_and_load_the_best_model(fsdp_runs):
    from mixprec.checkpoint import load_tensors

    run = fsdp_runs / "sharded" / "run"
    checkpoint = run / "checkpoint-2"
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    assert len(list((checkpoint / "model_0.dcp").glob("*.distcp"))) == 2  # one shard file per process
    assert (checkpoint / "optimizer_0.dcp" / ".metadata").is_file()
    # load_best_model_at_end read the shards back: the saved model is the best step's, as in the full run
    saved = load_tensors(fsdp_runs / "sharded" / "saved" / "model.safetensors")
    best = load_tensors(fsdp_runs / "fsdp" / "run" / "checkpoint-2" / "model.safetensors")
    assert saved.keys() == best.keys() and all(torch.equal(saved[name], best[name]) for name in best)


def test_a_trainer_resumed_from_sharded_checkpoints_ends_as_the_uninterrupted_run(fsdp_runs):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def full(checkpoint: Path, part: str) -> dict:
        dcp_to_torch_save(str(checkpoint / part), str(checkpoint.parent / f"{part}.pt"))
        return torch.load(checkpoint.parent / f"{part}.pt", weights_only=True)

    uninterrupted = fsdp_runs / "sharded" / "run" / "checkpoint-3"
    resumed = fsdp_runs / "resumed" / "run" / "checkpoint-3"
    for part in ("model_0.dcp", "optimizer_0.dcp"):
        a, b = full(uninterrupted, part), full(resumed, part)
        flat_a, flat_b = torch.utils._pytree.tree_flatten(a), torch.utils._pytree.tree_flatten(b)
        assert flat_a[1] == flat_b[1], part  # the same entries
        for x, y in zip(flat_a[0], flat_b[0]):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, (part, x, y)  # bit for bit
