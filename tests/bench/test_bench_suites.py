"""benchmarks/: compare_loops' stepping, dtype detection and goal verdicts; gpu_suite's CPU-independent parts.

The scripts are run for their figures, not here; these tests check the machinery those figures rest on.
Run from the repository root (``python -m pytest``), which puts ``benchmarks`` on the import path.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from benchmarks import _loops, compare_loops, gpu_suite

# -- compare_loops -----------------------------------------------------------------------------------------


def _fake_trainer(gate: _loops._Gate, total: int, seen: list[int]):
    def train():
        gate.train_begin()
        for step in range(total):
            seen.append(step)
            gate.step_end()

    return train


TINY_DRY_RUN = [
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--warmup",
    "1",
]
"""gpu_suite.py's whole path on the CPU, at a size that runs in a second."""


def test_a_parked_trainer_runs_exactly_the_steps_it_is_granted():
    gate, seen = _loops._Gate(), []
    observer = _loops.DtypeObserver(torch.nn.Linear(2, 2))
    stepper = _loops.ThreadStepper("fake", observer, _fake_trainer(gate, 5, seen), gate, tmp="/nonexistent")
    assert seen == []  # parked before its first step
    stepper.steps(2)
    assert len(seen) == 2
    stepper.steps(3)
    assert len(seen) == 5
    stepper.close()
    assert not any(t.name == "fake" and t.is_alive() for t in threading.enumerate())


def test_a_trainer_that_fails_in_its_thread_raises_in_the_caller():
    gate = _loops._Gate()

    def train():
        gate.train_begin()
        raise ValueError("boom")

    stepper = _loops.ThreadStepper("broken", _loops.DtypeObserver(torch.nn.Linear(1, 1)), train, gate, "/nonexistent")
    with pytest.raises(RuntimeError, match="broken failed in its training thread"):
        stepper.steps(1)
    stepper.close()


def test_dtype_observer_sees_what_autocast_computed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    observer = _loops.DtypeObserver(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(3, 4))
    assert observer.seen == {"bfloat16"}
    observer.remove()
    model(torch.randn(3, 4))
    assert observer.seen == {"bfloat16"}  # removed hooks record nothing more


def test_ran_as_flags_a_loop_that_did_not_compute_in_the_asked_dtype():
    assert compare_loops._ran_as({"asked": "fp16", "matmul_dtypes": ["float16"]}) == "float16"
    flagged = compare_loops._ran_as({"asked": "fp16", "matmul_dtypes": ["float32"]})
    assert "NOT what was asked" in flagged


def _row(name, ms, dtypes=("float16",), ratio=None, mem=100):
    return {
        "variant": name,
        "matmul_dtypes": list(dtypes),
        "step_time_s": ms / 1e3,
        "ratio_vs_floor": ratio,
        "peak_mem_bytes": mem,
    }


def test_goal_verdicts_follow_the_stated_limits():
    block = {
        "precision": "fp16",
        "rows": [
            _row("torch.amp by hand", 100, ratio=1.0, mem=100),
            _row("no loss scaling", 96),
            _row("mixprec GradScaler", 101, mem=104),
            _row("mixprec Accelerator", 103, ratio=1.03, mem=106),
            _row("mixprec Trainer", 104, ratio=1.04),
            _row("HF Trainer", 20, dtypes=("float32",)),
        ],
    }
    goals = "\n".join(compare_loops._goals(block))
    assert "mixprec Accelerator <= 1.02x floor: 1.030x -> NOT met" in goals
    assert "mixprec Trainer <= 1.05x floor: 1.040x -> met" in goals
    assert "NOT met (not like for like: HF Trainer computed in float32)" in goals
    assert "fp16 with loss scaling <= 1.05x without: 1.052x -> NOT met" in goals
    assert "NOT met by mixprec Accelerator" in goals  # 106 > 100 + 5%


def test_scaling_goal_is_only_judged_for_fp16():
    block = {"precision": "bf16", "rows": [_row("no loss scaling", 100), _row("mixprec GradScaler", 200)]}
    assert not any("loss scaling" in g for g in compare_loops._goals(block))


@pytest.mark.slow
def test_compare_loops_runs_trainers_interleaved_and_reports_real_dtypes(tmp_path, capsys):
    out = tmp_path / "loops.json"
    variants = "torch.amp by hand,mixprec Trainer,HF Trainer"
    argv = [
        "--precisions",
        "fp16",
        "--variants",
        variants,
        "--rounds",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--no-memory",
        "--json",
        str(out),
        "--threads",
        str(torch.get_num_threads()),
    ]  # the script sets it: keep the suite's
    assert compare_loops.main(argv) == 0
    (block,) = json.loads(out.read_text())["blocks"]
    rows = {r["variant"]: r for r in block["rows"]}
    assert rows["torch.amp by hand"]["matmul_dtypes"] == ["float16"]
    assert rows["mixprec Trainer"]["matmul_dtypes"] == ["float16"]  # really fp16 on a CPU, as asked
    assert rows["HF Trainer"]["matmul_dtypes"]  # whatever HF did, it was observed and reported
    assert rows["torch.amp by hand"]["ratio_vs_floor"] == 1.0
    assert "## fp16" in capsys.readouterr().out


# -- gpu_suite ---------------------------------------------------------------------------------------------


def test_gpu_suite_mfu_is_model_flops_over_the_measured_peak():
    assert gpu_suite.mfu(1e9, 1e4, 1e14) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        gpu_suite.mfu(1.0, 1.0, 0.0)


@pytest.mark.parametrize("argv", [["--variants", "fp4"], ["--steps", "0"], ["--warmup", "0"]])
def test_gpu_suite_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(argv)


def test_gpu_suite_defaults_are_the_gpt2_shape_in_bf16_with_compile():
    a = gpu_suite.parse_args([])
    assert a.model == "gpt2" and a.seq_len == 1024
    assert "bf16+compile" in a.variants and gpu_suite.VARIANTS["bf16+compile"][:2] == ("bf16", True)
    assert "fp8+compile" not in a.variants  # the lean rows are asked for by name


def test_gpu_suite_cpu_dry_run_of_the_lean_rows_converts_the_model(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    from mixprec.bench import peak

    monkeypatch.setenv("MIXPREC_FP8_EMULATE", "1")  # the test-only switch: a CPU has no fp8 matmuls
    monkeypatch.setattr(peak, "_MAX_SIZE", {"cuda": 8192, "cpu": 256})
    out = tmp_path / "gpu.json"
    argv = [*TINY_DRY_RUN, "--variants", "bf16,fp8,bf16-pure", "--json", str(out)]
    assert gpu_suite.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["fp8"]["precision"] == "fp8" and rows["bf16-pure"]["precision"] == "bf16-pure"
    assert rows["fp8"]["peak_flops_per_s"] == rows["bf16"]["peak_flops_per_s"]  # fp8 against the bf16 peak
    assert all(r["final_loss"] > 0 and r["mfu"] > 0 for r in rows.values())


def test_the_1b_shape_is_about_a_billion_parameters():
    from mixprec.models import GPT_PRESETS, GPTConfig

    c = GPTConfig(**{f: getattr(GPT_PRESETS["gpt-1b"], f) for f in ("vocab_size", "n_layer", "n_embd")})
    blocks = c.n_layer * 12 * c.n_embd**2  # attention 4 d^2 + MLP 8 d^2 per block
    assert 0.8e9 < blocks + c.vocab_size * c.n_embd < 1.1e9


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_suite_without_cuda_says_so_and_succeeds(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu_suite.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"skipped": "no CUDA device"}


def test_gpu_suite_cpu_dry_run_goes_through_the_whole_path(tmp_path, monkeypatch):
    from mixprec.bench import peak

    monkeypatch.setattr(peak, "_MAX_SIZE", {"cuda": 8192, "cpu": 256})
    out = tmp_path / "gpu.json"
    argv = [*TINY_DRY_RUN, "--variants", "fp32,bf16", "--json", str(out)]
    assert gpu_suite.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["results"]] == ["fp32", "bf16"]
    for r in doc["results"]:
        assert r["step_time_s"] > 0 and 0 < r["mfu"]
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / r["step_time_s"])


@pytest.mark.gpu
def test_gpu_suite_compiled_bf16_on_a_gpu(tmp_path):
    out = tmp_path / "gpu.json"
    argv = [
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--variants",
        "bf16,bf16+compile",
        "--json",
        str(out),
    ]
    assert gpu_suite.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert all(r["peak_mem_bytes"] > 0 and r["mfu"] > 0 for r in rows)


def test_the_issue28_plan_records_failures_skips_what_the_time_limit_leaves_and_states_the_goals(tmp_path, monkeypatch):
    from benchmarks import _gpu_plan

    def nanogpt(a, out, left):
        rows = [
            {"variant": "nanogpt", "tokens_per_s": 400e3, "peak_mem_bytes": 2**31, "mfu": 0.45},
            {"variant": "mixprec+chunked", "tokens_per_s": 460e3, "peak_mem_bytes": 2**30, "mfu": 0.52},
        ]
        return {"rows": rows}

    def broken(a, out, left):
        raise RuntimeError("planted")

    def slow(a, out, left):
        time.sleep(0.3)
        return {"summary": "3 passed"}

    monkeypatch.setattr(_gpu_plan, "RUNNERS", {**_gpu_plan.RUNNERS, "tests": slow, "nanogpt": nanogpt, "gpt2": broken})
    monkeypatch.setattr(_gpu_plan, "MIN_SECONDS", {**_gpu_plan.MIN_SECONDS, "tests": 0, "nanogpt": 0, "gpt2": 0})
    a = gpu_suite.parse_args(
        [
            "--plan",
            "issue28",
            "--out",
            str(tmp_path),
            "--sections",
            "tests,nanogpt,gpt2,gpt-1b",
            "--time-limit",
            "100",
            "--device",
            "cpu",
        ]
    )
    assert _gpu_plan.run_plan(a, gpu_suite.variants_table) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    sections = doc["sections"]
    assert sections["gpt2"]["error"] == "RuntimeError: planted"  # recorded, and the plan went on
    assert "not started" in sections["gpt-1b"]["not_run"]  # 120 s needed, under 100 left
    assert "gpu tests: 3 passed" in doc["lines"]
    assert any(line.startswith("mixprec+chunked vs nanoGPT (bf16 + compile): 1.150x tokens/s") for line in doc["lines"])
    assert (tmp_path / "nanogpt.json").exists()
