"""Two processes under torchrun (gloo, CPU): DDP and FSDP2 through the Accelerator.

One launch of tests/strategies/test_distributed_worker.py (about 10 s of work plus two torch imports) runs every
scenario; each test below asserts one behaviour on the JSON files the two processes wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mixprec import Accelerator
from mixprec.precision.probe import PREFILTER_RATIO, gemm_ratio

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"),
]

WORKER = Path(__file__).with_name("test_distributed_worker.py")
N_SAMPLES = 36
KINDS = ("ddp-fp32", "ddp-fp16", "fsdp-fp32", "fsdp-fp16", "fsdp-bf16-pure")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(WORKER),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def test_accelerator_joins_the_torchrun_group_itself(ranks: list[dict]) -> None:
    # The worker never calls init_process_group: the Accelerator read RANK/WORLD_SIZE/MASTER_* itself.
    assert ranks[0]["world"] == {"num_processes": 2, "backend": "gloo"}
    assert ranks[0]["ddp-fp32"]["kind"] == "MULTI_CPU"  # DDP by default with WORLD_SIZE > 1; accelerate's name
    assert ranks[0]["fsdp-fp32"]["kind"] == "FSDP"


def test_a_prepared_scheduler_advances_once_per_process_as_accelerates_unless_counted_in_optimizer_steps(
    ranks: list[dict],
) -> None:
    # accelerate's scripts size the schedule from the unsharded DataLoader; mixprec's Trainer in optimizer steps
    assert ranks[0]["scheduler_lrs"] == {"accelerate": pytest.approx(0.8), "optimizer_steps": pytest.approx(0.9)}


def test_accelerates_local_sgd_trains_locally_then_averages_the_ranks(ranks: list[dict]) -> None:
    # accelerate's LocalSGD accepts mixprec's distributed_type and enters the prepared model's no_sync()
    run = ranks[0]["local_sgd"]
    assert run["distributed_type"] == "MULTI_CPU" and run["enabled"]
    before, after = torch.tensor(run["before"]), torch.tensor(run["after"])
    assert not torch.equal(before[0], before[1])  # gradients stayed local: each rank stepped on its own data
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)  # then every rank holds the same weights
    torch.testing.assert_close(after[0], before.mean(0), rtol=1e-6, atol=1e-7)  # their mean


@pytest.mark.parametrize("kind", ["ddp-fp32", "ddp-fp16"])
def test_ddp_ranks_end_with_identical_parameters(ranks: list[dict], kind: str) -> None:
    a, b = ranks[0][kind]["local_params"], ranks[1][kind]["local_params"]
    assert a == b  # exact: every rank applied the same all-reduced update


def test_ddp_fp16_steps_fp32_masters_of_a_half_head_identically_on_every_rank(ranks: list[dict]) -> None:
    a, b = ranks[0]["half-base"], ranks[1]["half-base"]
    assert a["dtypes"] == ["torch.float16", "torch.float32"]
    assert a["master"] == b["master"] and a["head"] == b["head"]  # the all-reduced gradient reached both
    assert a["frozen_unchanged"] and b["frozen_unchanged"]
    assert a["head"] == [float(torch.tensor(x).half()) for x in a["master"]]  # refreshed from its master


@pytest.mark.parametrize("kind", KINDS)
def test_each_sample_seen_exactly_once_per_epoch(ranks: list[dict], kind: str) -> None:
    per_rank = [r[kind]["indices"] for r in ranks]
    for epoch, (mine, theirs) in enumerate(zip(*per_rank)):
        assert sorted(mine + theirs) == list(range(N_SAMPLES)), f"epoch {epoch}"
    assert per_rank[0][0] != per_rank[0][1], "set_epoch was not applied: epochs 0 and 1 have one order"
    assert ranks[0][kind]["batches_per_epoch"] == ranks[1][kind]["batches_per_epoch"] == 5


@pytest.mark.parametrize("kind", KINDS)
def test_loss_falls(ranks: list[dict], kind: str) -> None:
    losses = ranks[0][kind]["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


@pytest.mark.parametrize("kind", ["ddp-fp16", "fsdp-fp16"])
def test_inf_on_one_rank_skips_the_step_on_every_rank(ranks: list[dict], kind: str) -> None:
    # The inf was planted in rank 1's gradient only (under FSDP: in its shard); the found_inf all-reduce makes
    # both ranks skip and back off alike. Full parameters are compared where they live (rank 0 under FSDP).
    for r in ranks:
        assert r[kind]["inf"] == {"skipped": True, "scale": 32768.0, "unchanged": True, "lr_unchanged": True}


def test_accumulation_skips_the_gradient_all_reduce_until_the_last_micro_batch(ranks: list[dict]) -> None:
    assert ranks[0]["no_sync"] == {
        "micro0_sync": False,
        "micro0_equal_across_ranks": False,  # local gradients of different data
        "micro1_sync": True,
        "micro1_equal_across_ranks": True,  # all-reduced
    }


def test_fsdp2_accumulates_like_ddp(ranks: list[dict]) -> None:
    # FSDP2 skips its reduce-scatter on the first micro-batch (set_requires_gradient_sync(False)) and
    # reduces the sum on the second; fp32, so the tolerance is that of test_fsdp2_agrees_with_ddp.
    ddp, fsdp = ranks[0]["accumulated"]["ddp"], ranks[0]["accumulated"]["fsdp"]
    for name, values in ddp.items():
        assert max(abs(x - y) for x, y in zip(values, fsdp[name])) <= TOLERANCE["fp32"], name


# FSDP2 vs DDP. fp32: the same arithmetic up to reduction order (observed: identical). fp16: FSDP2
# gathers fp16 weights (MixedPrecisionPolicy), so embedding lookups and additions that autocast leaves
# alone run in fp16 there, fp32 under DDP; over 15 AdamW steps the observed gap is ~1.4e-4.
TOLERANCE = {"fp32": 1e-6, "fp16": 2e-3}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_fsdp2_agrees_with_ddp(ranks: list[dict], precision: str) -> None:
    ddp, fsdp = ranks[0][f"ddp-{precision}"], ranks[0][f"fsdp-{precision}"]
    assert fsdp["state_keys"] == ddp["state_keys"]  # the user's module's keys, no wrapper prefixes
    tol = TOLERANCE[precision]
    for name, values in ddp["params"].items():
        worst = max(abs(x - y) for x, y in zip(values, fsdp["params"][name]))
        assert worst <= tol, f"{name}: |ddp - fsdp| = {worst:.3g} > {tol}"
    assert max(abs(x - y) for x, y in zip(ddp["losses"], fsdp["losses"])) <= tol


@pytest.mark.parametrize("kind", KINDS)
def test_save_state_and_load_state_across_processes(ranks: list[dict], kind: str) -> None:
    for r in ranks:
        state = r[kind]["state"]
        assert state["rng_restored"] and state["scale_restored"]
        assert state["params_restored"]
    assert {"rng_state_0.pt", "rng_state_1.pt", "model.safetensors", "optimizer.pt"} <= set(
        ranks[0][kind]["state"]["files"]
    )


def test_partial_state_splits_inputs_between_processes(ranks: list[dict]) -> None:
    # 5 items over 2 processes: the first gets the extra one; padded shares repeat the last item
    assert ranks[0]["split"] == [0, 1, 2] and ranks[1]["split"] == [3, 4]
    assert ranks[0]["split_padded"] == ranks[1]["split_padded"] == [0, 1, 2, 3, 4, 4]


@pytest.mark.parametrize(("case", "steps", "samples"), [("stream23", 3, 23), ("stream17", 2, 17), ("sampler", 2, 12)])
def test_dispatched_batches_reach_each_process_once_in_the_same_number_of_steps(
    ranks: list[dict], case: str, steps: int, samples: int
) -> None:
    batches = [r["dispatched"][case] for r in ranks]
    assert [len(b) for b in batches] == [steps, steps]  # every process runs the same number of steps
    seen = sorted(i for per_rank in batches for batch in per_rank for i in batch)
    if case == "sampler":  # drawn with replacement: 12 draws, each handed to exactly one process
        assert len(seen) == samples
    else:
        assert seen == list(range(samples))  # each sample exactly once


def test_a_batch_the_main_process_cannot_split_fails_on_every_process(ranks: list[dict]) -> None:
    for r in ranks:
        assert "every leaf of a batch must be a tensor" in r["dispatched"]["bad_batch"]


def test_a_stream_without_dispatch_is_refused_with_the_fix(ranks: list[dict]) -> None:
    assert "IterableDataset across 2 processes" in ranks[0]["dispatched"]["refused"]
    assert "dispatch_batches=True" in ranks[0]["dispatched"]["refused"]


def test_gather_accepts_different_row_counts(ranks: list[dict]) -> None:
    assert ranks[0]["uneven_gather"] == ranks[1]["uneven_gather"] == [0, 0, 1]


def test_gather_for_metrics_joins_what_is_not_tensors_as_objects(ranks: list[dict]) -> None:
    for r in ranks:
        gathered = r["metrics_objects"]
        assert gathered["text"] == ["text 0", "text 1", "text 1"]
        assert gathered["number"] == [0.5, 1.5]
        assert gathered["asked"] == [0, 1]


def test_a_trigger_set_on_one_process_is_seen_by_every_process(ranks: list[dict]) -> None:
    assert ranks[0]["trigger"] == ranks[1]["trigger"] == [False, True, False]


def test_pad_across_processes_makes_ragged_sequences_gatherable(ranks: list[dict]) -> None:
    # accelerate's pad_across_processes: rank 0 holds 3 columns, rank 1 holds 4
    for rank in ranks:
        assert rank["padded"]["after"] == [[1, 1, 1, -100]] * 2 + [[2, 2, 2, 2]] * 2
        assert rank["padded"]["first"] == [[-100, 1, 1, 1]] * 2 + [[2, 2, 2, 2]] * 2
        assert rank["padded"]["last"] == rank["padded"]["after"]
    assert ranks[0]["padded"]["nested"] == [[2, 4], [1, 1, 1]] and ranks[1]["padded"]["nested"] == [[2, 4], [2] * 4]


def test_every_rank_takes_the_main_ones_words_in_autos_agreement_not_only_mode_names(ranks: list[dict]) -> None:
    # a mask over the modes' names once dropped "settled" and "stop": under several processes every warm-up ran
    # MAX_WARMUP trials and every race MAX_ROUNDS rounds (a 10-step DDP run raced for 7.9 s)
    assert ranks[0]["agreed"] == ranks[1]["agreed"] == ["bf16", "settled", "stop"]


def test_auto_races_once_and_every_rank_trains_in_the_main_ones_choice(ranks: list[dict]) -> None:
    a, b = ranks[0]["auto"], ranks[1]["auto"]
    assert a["chosen"] == b["chosen"] in ("fp32", "fp16", "bf16")
    assert (a["source"], b["source"]) == ("measured", "main process")
    assert a["params"] == b["params"]  # the same mode and the same updates after the race


def test_under_ddp_auto_leaves_out_what_the_main_ones_probe_finds_emulated_on_every_rank(ranks: list[dict]) -> None:
    # fp16 emulated on a CPU (17-21x fp32's matmul time) was raced under several processes: warm-ups and rounds
    # of a mode that could never win, in lockstep
    a, b = ranks[0]["auto"], ranks[1]["auto"]
    assert a["excluded"] == b["excluded"]
    emulated = gemm_ratio(torch.float16) >= PREFILTER_RATIO  # this machine: the ranks probed the same CPU
    assert ("emulated on this CPU" in a["excluded"].get("fp16", "")) == emulated


def test_auto_races_as_the_training_steps_in_lockstep_under_ddp(ranks: list[dict]) -> None:
    a, b = ranks[0]["auto-in-run"], ranks[1]["auto-in-run"]
    assert a["source"] == "measured" and b["source"] == "main process"
    assert a["chosen"] == b["chosen"] and a["race_steps"] == b["race_steps"] == a["steps"] > 0
    assert a["params"] == b["params"]  # every step, the race's too, the same mode and update on every rank


def test_auto_races_in_lockstep_under_fsdp(ranks: list[dict]) -> None:
    a, b = ranks[0]["auto-fsdp"], ranks[1]["auto-fsdp"]
    assert a["chosen"] == b["chosen"] and (a["source"], b["source"]) == ("measured", "main process")


def test_leaving_the_group_waits_until_the_backend_holds_no_tensor_of_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    # In process, a one-process gloo group (the same collectives and worker threads as under torchrun). gloo's
    # worker thread drops its reference to a collective's tensors only after wait() has returned; if that
    # reference is the tensor's last, the thread must free its Python object, and doing so while the interpreter
    # shuts down aborted finished workers (SIGABRT, "terminate called without an active exception"). The strategy
    # lends the backend aliases it keeps until the backend lets go, and end_training destroys the group only
    # once none is lent.
    acc = Accelerator(cpu=True, distributed="ddp", verbose=False)
    strategy = acc._strategy
    try:
        lent = []
        for i in range(200):
            total = acc.reduce(torch.tensor([float(i), 1.0]), reduction="sum")  # the caller drops it at once
            lent.append(len(strategy._handed))
        assert total.tolist() == [199.0, 1.0]  # results land in the caller's tensor, not only in the alias
        assert acc.gather(torch.arange(3)).tolist() == [0, 1, 2]
        assert max(lent) <= 6  # let go of as the backend does: not one kept per collective for the whole run
        at_destroy: list[list[int]] = []
        destroy = dist.destroy_process_group

        def watched(*args, **kwargs):
            at_destroy.append([alias._use_count() for alias in strategy._handed])
            return destroy(*args, **kwargs)

        monkeypatch.setattr(dist, "destroy_process_group", watched)
    finally:
        acc.end_training()
    assert at_destroy == [[]]  # nothing lent when the group went
    assert not dist.is_initialized()


# -- gradients on the wire in bf16 / fp16 (comm_dtype) -------------------------------------------------------
# Against the fp32 all-reduce of the same run (ddp-fp32 / fsdp-fp32: same init, data and 10 AdamW steps at lr
# 2e-2). Observed: losses within 4.1e-4 (bf16) / 5.3e-6 (fp16) at every step; parameters within 3.9e-2 / 8.3e-5.
# Adam divides by sqrt(v), so a near-zero gradient whose rounding differs moves its weight by up to lr per step:
# parameter bounds are 0.1 (bf16: half of 10 steps x lr) and 2e-3 (fp16, 8x finer); loss bounds 5e-3 / 5e-4.
COMM_TOLERANCE = {"bf16": (5e-3, 0.1), "fp16": (5e-4, 2e-3)}  # (loss, parameter)


@pytest.mark.parametrize("kind", ["ddp-bf16", "ddp-fp16", "fsdp-bf16"])
def test_low_precision_gradients_on_the_wire_train_like_fp32(ranks: list[dict], kind: str) -> None:
    distributed, comm = kind.split("-")
    low, full = ranks[0]["comm"][kind], ranks[0][f"{distributed}-fp32"]
    loss_tol, tol = COMM_TOLERANCE[comm]
    assert max(abs(a - b) for a, b in zip(low["losses"], full["losses"])) <= loss_tol
    for name, values in full["params"].items():
        worst = max(abs(a - b) for a, b in zip(values, low["params"][name]))
        assert worst <= tol, f"{name}: |{comm} wire - fp32 wire| = {worst:.3g} > {tol}"
    assert low["params"] != full["params"]  # the wire really was 16-bit (fp32 would be bit-identical)


def test_an_overflow_on_the_fp16_wire_is_a_skipped_step_on_every_rank(ranks: list[dict]) -> None:
    # Rank 1's scaled gradient (~6e5) is finite in fp32 and beyond fp16's range only on an fp16 wire: the inf
    # reaches both ranks through the all-reduce, the scaler finds it, both skip and back off. The fp32 wire,
    # same gradients, steps: so the skip came from the wire, and no inf was silently applied.
    for r in ranks:
        assert r["comm_overflow"]["fp16"] == {
            "skipped": True,
            "finite_after_all_reduce": False,
            "unchanged": True,
            "scale": 32768.0,
        }
        assert r["comm_overflow"]["fp32"] == {
            "skipped": False,
            "finite_after_all_reduce": True,
            "unchanged": False,
            "scale": 65536.0,
        }
