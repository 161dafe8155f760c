"""Every script in examples/ runs, as a user runs it (a subprocess, from a scratch folder), and prints what its
guide says it shows. The migration pairs show the difference each guide describes: the "before" script trains
in fp32 or without loss scaling on a CPU, the "after" one, with one import changed, really computes in fp16."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
QUICK = ["--corpus-bytes", "20000", "--batch-size", "4", "--seq-len", "32"]

# script -> (arguments, what its output must contain)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "gradscaler_loop.py": ([], ["scale 65536, skipped 0 of 6 steps"]),
    "accelerator_loop.py": (["--max-steps", "2", *QUICK], ["done: 2 optimizer steps"]),
    "trainer_snippet.py": (["--corpus-bytes", "2000", "--seq-len", "32"], ["epoch 3: eval_loss"]),
    "trainer_datasets.py": ([], ["eval accuracy"]),
    "lora_half_base.py": ([], ["adapter parameters ({torch.float32}) on a frozen {torch.bfloat16} base"]),
    "distributed_comm.py": ([], ["1 process(es), NO, gradients in bf16"]),
    "bf16_pure_lean.py": ([], ["bf16-pure + adamw_torch: weights torch.bfloat16, 8.00 bytes/param"]),
    "watch_overflow.py": ([], ["first non-finite in 'up' (forward, output)"]),
    "migration/torch_amp_before.py": ([], ["computed in ['torch.float16'], loss scaling OFF"]),
    "migration/torch_amp_after.py": ([], ["computed in ['torch.float16'], loss scaling on"]),
    "migration/accelerate_before.py": ([], ["accelerate: computed in ['torch.float32']"]),
    "migration/accelerate_after.py": ([], ["mixprec: computed in ['torch.float16']"]),
    "migration/hf_trainer_before.py": ([], ["HF Trainer: computed in ['torch.float32']"]),
    "migration/hf_trainer_after.py": ([], ["mixprec Trainer: computed in ['torch.float16']"]),
    "migration/nanogpt_before.py": ([], ["asked for float16, computed in ['torch.float32'], loss scaling OFF"]),
    "migration/nanogpt_after.py": ([], ["asked for float16, computed in ['torch.float16'], loss scaling on"]),
}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "MIXPREC_AUTO_CACHE": "0"}


# One interpreter runs every script in turn (runpy, each as __main__ with its own argv, folder and stdout), so
# torch, transformers and mixprec are imported once rather than sixteen times: the suite's time is what it is.
RUNNER = """
import contextlib, io, json, os, runpy, sys, traceback
cases, out_path = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for script, args, cwd in cases:
    os.makedirs(cwd, exist_ok=True)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            runpy.run_path(script, run_name="__main__")
        results[script] = {"ok": True, "stdout": buffer.getvalue()}
    except BaseException:
        results[script] = {"ok": False, "stdout": buffer.getvalue(), "error": traceback.format_exc()}
    finally:
        sys.path.remove(os.path.dirname(script))
with open(out_path, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("examples")
    cases = [[str(EXAMPLES / name), args, str(work / name.replace("/", "_"))] for name, (args, _) in CASES.items()]
    out = work / "results.json"
    cmd = [sys.executable, "-c", RUNNER, json.dumps(cases), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=work, timeout=900)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    return {str(Path(k).relative_to(EXAMPLES)): v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script: str, ran: dict[str, dict]) -> None:
    result = ran[script]
    assert result["ok"], result.get("error", "")[-3000:]
    for text in CASES[script][1]:
        assert text in result["stdout"], result["stdout"][-2000:]


def _torchrun(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` under torchrun with two processes; its exit status checked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    proc = subprocess.run(
        [*cmd, str(EXAMPLES / script), *args], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_distributed_example_under_torchrun(distributed: str, tmp_path: Path) -> None:
    proc = _torchrun(tmp_path, "distributed_comm.py", "--distributed", distributed)
    kind = {"ddp": "MULTI_CPU", "fsdp": "FSDP"}[distributed]
    assert f"2 process(es), {kind}, gradients in bf16" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_max_steps_counts_each_processs_optimizer_steps_under_torchrun(tmp_path: Path) -> None:
    """--max-steps 3 with two processes: 3 steps, over which the schedule runs (it ran 6, the last 3 at the
    schedule's end)."""
    proc = _torchrun(tmp_path, "accelerator_loop.py", "--max-steps", "3", "--precision", "fp32", *QUICK)
    assert "step 3/3" in proc.stdout and "done: 3 optimizer steps" in proc.stdout, proc.stdout[-2000:]
