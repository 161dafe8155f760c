"""Lost and stuck peers, and torchelastic restarts that resume by themselves.

The torchrun tests launch tests/strategies/elastic_worker.py (2 processes, gloo, a 12-step fp16 Trainer run
with dropout) and are slow (two torch imports per launch, about 10 s each on 2 cores); the rest run in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mixprec import Accelerator, Trainer, TrainerCallback, TrainingArguments
from mixprec.checkpoint.folders import trainer_folders
from mixprec.strategies.peers import PeerLostError, explain, is_collective_failure, silent_ranks
from mixprec.strategies.restarts import restarted_by_launcher
from trainer_utils import assert_bit_identical, make_examples, make_model

WORKER = Path(__file__).with_name("elastic_worker.py")
ACCELERATOR_WORKER = Path(__file__).with_name("elastic_accelerator_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), **(extra or {}))
    return base


def torchrun(
    out: Path, *flags: str, env: dict[str, str] | None = None, timeout: int = 180, worker: Path = WORKER
) -> int:
    """Launch the worker under torchrun on the loopback address; the launcher's exit status."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        *flags,
        str(worker),
        str(out),
    ]
    with open(out / "launcher.log", "w") as log:
        return subprocess.run(cmd, env=_env(env), stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode


def two_nodes(
    out: Path,
    node_env: tuple[dict[str, str], dict[str, str]] = ({}, {}),
    *flags: str,
    launcher: str = "torch.distributed.run",
) -> list[subprocess.Popen]:
    """Two launchers of one process each, meeting at a c10d rendezvous on 127.0.0.1: a 2-node job in
    miniature. Each launcher gets a session of its own, so a "node" can be killed whole."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    nnodes = [f for f in flags if f.startswith("--nnodes")] or ["--nnodes=2"]
    flags = tuple(f for f in flags if not f.startswith("--nnodes"))
    for node, extra in enumerate(node_env):
        cmd = [
            sys.executable,
            "-m",
            launcher,
            *nnodes,
            "--nproc_per_node=1",
            *flags,
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two-nodes",
            "--local-addr=127.0.0.1",
            str(WORKER),
            str(out),
        ]
        log = open(out / f"node{node}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(
            subprocess.Popen(cmd, env=_env(extra), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        if node == 0:  # node 0 hosts the rendezvous store (torchelastic's c10d backend: the first to bind it)
            _wait_for_listener(port)
    return procs


def _wait_for_listener(port: int, timeout: float = 60.0) -> None:
    """Until something accepts connections on 127.0.0.1:``port``. The tests kill node 1 only: losing the
    node that hosts the c10d rendezvous store ends the whole job, by torchelastic's design."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no rendezvous store listening on 127.0.0.1:{port} after {timeout:g} s")


def final(out: Path, rank: int) -> dict:
    return json.loads((out / f"final_rank{rank}.json").read_text())


def as_tensors(report: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in report["params"].items()}


# -- one process ----------------------------------------------------------------------------------------


def test_silent_ranks_are_those_that_never_check_in_at_the_store() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_RUN_ID": "t"}
    store.set("mixprec/alive/t/0/0", "1")  # rank 0 already checked in; rank 2 never will
    assert silent_ranks(1, 3, wait_s=0.5, environ=env) == (2,)


def test_no_store_to_ask_means_unknown() -> None:
    assert silent_ranks(0, 2, wait_s=0.1, environ={}) is None


def test_the_message_names_the_rank_and_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    err = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    assert is_collective_failure(err) and not is_collective_failure(ValueError("timed out"))
    lost = explain(err, rank=0, world_size=2, timeout_s=5)
    assert isinstance(lost, PeerLostError) and lost.ranks == (1,)
    assert "rank 1 did not answer" in str(lost) and "5 s timeout" in str(lost) and "ddp_timeout" in str(lost)


@pytest.mark.parametrize("bad", [0, -1, True, "300"])
def test_a_bad_timeout_is_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="timeout"):
        Accelerator(cpu=True, timeout=bad, verbose=False)
    with pytest.raises(ValueError, match="ddp_timeout"):
        TrainingArguments(output_dir="x", ddp_timeout=bad)


def test_the_timeout_reaches_the_process_group(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, distributed="ddp", timeout=7, verbose=False)
    try:
        assert acc.config.timeout == 7
        # torch keeps the default group's options where only it looks; the strategy's copy is what went there
        assert acc.explain_failure(ValueError("x")).__class__ is ValueError
    finally:
        acc.end_training()


class Steps(TrainerCallback):
    """Records the step a run starts from; ends it (as a lost process would) once ``stop_at`` steps are done."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at, self.first = stop_at, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.first = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def _trainer(out: Path, steps: Steps | None = None, **kwargs: object) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        save_plots=False,
        use_cpu=True,
        **kwargs,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_examples(40))
    trainer.add_callback(steps or Steps())
    return trainer


def test_a_restarted_worker_group_resumes_from_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _trainer(tmp_path / "ref")
    reference.train()
    _trainer(tmp_path / "run", Steps(stop_at=3)).train()  # got to checkpoint-3, then lost a process
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    steps = Steps()
    restarted = _trainer(tmp_path / "run", steps)
    restarted.train()  # resume_from_checkpoint=None: under a restart, the newest complete checkpoint
    assert steps.first == 3  # resumed, not retrained from step 0
    assert_bit_identical(
        {k: v for k, v in restarted.model.state_dict().items()}, dict(reference.model.state_dict().items())
    )


def test_a_restart_with_no_checkpoint_starts_afresh_and_false_always_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restarted_by_launcher()
    trainer = _trainer(tmp_path / "empty")
    assert trainer.train().global_step == 6  # nothing to resume from: a fresh start, not an error
    steps = Steps()
    _trainer(tmp_path / "empty", steps).train(resume_from_checkpoint=False)
    assert steps.first == 0  # False: fresh even though checkpoints exist


# -- two processes under torchrun -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    assert torchrun(out) == 0, (out / "launcher.log").read_text()[-3000:]
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1])
def test_a_run_that_loses_a_process_restarts_resumes_and_ends_as_the_uninterrupted_one(
    tmp_path: Path, reference: Path, victim: int
) -> None:
    rc = torchrun(tmp_path, "--max-restarts=1", env={"ELASTIC_KILL": f"{victim}:5"})
    assert rc == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    assert (tmp_path / "killed").exists()  # the fault happened
    for rank in (0, 1):
        report = final(tmp_path, rank)
        assert report["restart"] == 1 and report["first_step"] == 3  # restarted, resumed from checkpoint-3
        assert_bit_identical(as_tensors(report), as_tensors(final(reference, rank)))


@pytest.mark.distributed
@pytest.mark.slow
def test_the_accelerator_restart_pattern_resumes_and_ends_as_the_uninterrupted_loop(tmp_path: Path) -> None:
    for name, flags, env in (("ref", (), {}), ("run", ("--max-restarts=1",), {"ELASTIC_KILL": "1:5"})):
        rc = torchrun(tmp_path / name, *flags, env=env, worker=ACCELERATOR_WORKER)
        assert rc == 0, (tmp_path / name / "launcher.log").read_text()[-3000:]
    assert (tmp_path / "run" / "killed").exists()  # the fault happened
    for rank in (0, 1):
        reference, report = final(tmp_path / "ref", rank), final(tmp_path / "run", rank)
        assert reference["resumed_from"] is None and reference["first_step"] == 0  # a first start loads nothing
        assert report["resumed_from"] == "checkpoint_0" and report["first_step"] == 3  # saved after step 3
        assert_bit_identical(as_tensors(report), as_tensors(reference))


def test_resume_after_restart_needs_automatic_naming_and_loads_nothing_on_a_first_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec import ProjectConfiguration

    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        Accelerator(cpu=True).resume_after_restart()
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert accelerator.resume_after_restart() is None  # not restarted
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert accelerator.resume_after_restart() is None  # restarted before any checkpoint: a fresh start
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.save_state()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert accelerator.resume_after_restart() == tmp_path / "checkpoints" / "checkpoint_0"
    assert_bit_identical(dict(model.state_dict()), saved)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stuck_peer_ends_the_survivor_within_the_timeout_naming_its_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    rc = torchrun(tmp_path, env={"ELASTIC_HANG": "1:4", "ELASTIC_TIMEOUT": "5"}, timeout=120)
    assert rc != 0 and time.monotonic() - start < 90  # the job ended; it did not hang
    stamp, message = (tmp_path / "error_rank0.txt").read_text().split("\n", 1)
    hung_at = float((tmp_path / "hung_at").read_text())
    assert message.startswith("PeerLostError: rank 0: rank 1 did not answer"), message
    # the 5 s timeout, plus up to 5 s asking the store who is missing, plus a loaded machine's slack
    assert float(stamp) - hung_at < 5 + 5 + 10
    assert trainer_folders(tmp_path / "run").latest().name == "checkpoint-3"  # the checkpoint is intact


def test_mixprec_train_restarted_by_the_launcher_resumes_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.cli import train as train_cli
    from mixprec.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_cli, "SAMPLE_BYTES", 8)
    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)))
    run = str(tmp_path / "run")
    argv = [
        "train",
        "--data",
        str(corpus),
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--epoch-tokens",
        "256",
        "--precision",
        "fp32",
        "--epochs",
        "2",
        "--output-dir",
        run,
    ]
    assert main(argv) == 0
    assert main(argv) == 2  # the same command line again, by hand: refused (it would overwrite the run)
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # ... but run again by torchrun after a failure
    assert main(argv) == 0
    assert "already holds a run" not in capsys.readouterr().err
    # on several nodes with restarts allowed, a node's own count may say 0 after a restart: the processes
    # decide together once connected; here no process was restarted, so the used folder is refused still
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_on_the_loopback_train_as_one_launcher_of_two_processes(tmp_path: Path, reference: Path) -> None:
    procs = two_nodes(tmp_path)
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], [(tmp_path / f"node{i}.log").read_text()[-2000:] for i in (0, 1)]
    for rank in (0, 1):
        assert_bit_identical(as_tensors(final(tmp_path, rank)), as_tensors(final(reference, rank)))


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_that_lose_a_worker_restart_together_and_end_as_the_uninterrupted_run(
    tmp_path: Path, reference: Path
) -> None:
    # node 1's worker is SIGKILLed after step 5; both launchers restart their workers, which resume from
    # checkpoint-3. Only node 1's launcher counts a restart: node 0's may not (its count stays 0), and the
    # workers decide together to resume (mixprec.strategies.restarts)
    procs = two_nodes(tmp_path, ({}, {"ELASTIC_KILL": "any:5"}), "--max-restarts=2", launcher="mixprec.cli.torchrun")
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{i}.log").read_text()[-3000:] for i in (0, 1)]
    assert codes == [0, 0], logs
    assert (tmp_path / "killed").exists()  # the fault happened
    for rank in (0, 1):
        report = final(tmp_path, rank)
        assert report["first_step"] == 3 and report["world_size"] == 2, report  # resumed from checkpoint-3
        assert_bit_identical(as_tensors(report), as_tensors(final(reference, rank)))


@pytest.mark.distributed
@pytest.mark.slow
def test_mixprec_train_on_two_nodes_survives_a_killed_worker_and_resumes(tmp_path: Path) -> None:
    # the command line's own path: two launchers (`mixprec torchrun`), `-m mixprec.cli.main train` into a shared
    # --output-dir, one checkpoint per epoch; node 1's worker is SIGKILLed once checkpoint-4 exists. Both
    # nodes' workers restart (only node 1's launcher counts it), agree the run folder is theirs, and resume.
    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)))
    run = tmp_path / "run"
    train = [
        "-m",
        "mixprec.cli.main",
        "train",
        "--data",
        str(corpus),
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--epoch-tokens",
        "256",
        "--epochs",
        "10",
        "--precision",
        "fp32",
        "--output-dir",
        str(run),
    ]
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "mixprec.cli.torchrun",
            "--nnodes=2",
            "--nproc_per_node=1",
            "--max-restarts=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=cli",
            "--local-addr=127.0.0.1",
            *train,
        ]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(
            subprocess.Popen(cmd, env=_env(None), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        if node == 0:
            _wait_for_listener(port)
    try:
        deadline = time.monotonic() + 180
        while not (run / "checkpoint-4").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (run / "checkpoint-4").is_dir(), (tmp_path / "node1.log").read_text()[-3000:]
        workers = subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True).stdout.split()
        assert workers, "node 1's worker was not found"
        os.kill(int(workers[0]), signal.SIGKILL)
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert codes == [0, 0], [text[-3000:] for text in logs]
    assert "resuming from" in logs[0] + logs[1]  # the restarted workers continued the run
    assert "already holds a run" not in logs[0] + logs[1]
    summary = json.loads((run / "run.json").read_text())["summary"]
    # 10 epochs of 8 chunks, 2 x 2 chunks a step: 20 steps, the last checkpoint at the end
    assert trainer_folders(run).number_of(trainer_folders(run).latest()) == summary["global_step"] == 20, summary


@pytest.mark.distributed
@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_goes_on_alone_from_the_checkpoint(tmp_path: Path) -> None:
    # --nnodes=1:2: node 1 goes silent at step 4 and is then killed whole; the survivor's collective times
    # out, its launcher restarts it, the rendezvous closes with one node, and the run resumes from
    # checkpoint-3 at world size 1 and finishes
    flags = ("--nnodes=1:2", "--max-restarts=1", "--rdzv-conf=last_call_timeout=1")
    env = ({"ELASTIC_TIMEOUT": "10"}, {"ELASTIC_HANG": "any:4", "ELASTIC_TIMEOUT": "10"})
    procs = two_nodes(tmp_path, env, *flags, launcher="mixprec.cli.torchrun")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "hung_at").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "hung_at").exists(), (tmp_path / "node1.log").read_text()[-2000:]
        os.killpg(procs[1].pid, signal.SIGKILL)
        survivor = procs[0].wait(timeout=240)
    finally:
        (tmp_path / "release").touch()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert survivor == 0, (tmp_path / "node0.log").read_text()[-3000:]
    (error,) = tmp_path.glob("error_rank*.txt")  # the first round ended naming the silent rank
    assert "did not answer" in error.read_text()
    report = final(tmp_path, 0)
    assert report["world_size"] == 1 and report["first_step"] == 3 and report["global_step"] == 12, report


@pytest.mark.distributed
@pytest.mark.slow
def test_a_lost_node_stops_the_other_cleanly_with_the_checkpoint_intact(tmp_path: Path) -> None:
    # node 1's process stops answering at step 4 (after checkpoint-3); then the whole node is killed
    procs = two_nodes(tmp_path, ({"ELASTIC_TIMEOUT": "10"}, {"ELASTIC_HANG": "any:4", "ELASTIC_TIMEOUT": "10"}))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "hung_at").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "hung_at").exists(), (tmp_path / "node1.log").read_text()[-2000:]
        os.killpg(procs[1].pid, signal.SIGKILL)  # the node: its launcher and its worker
        survivor = procs[0].wait(timeout=120)
    finally:
        (tmp_path / "release").touch()  # the hung worker, orphaned by the node's kill, may end now
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert survivor != 0  # no restarts allowed: the job stops
    errors = list(tmp_path.glob("error_rank*.txt"))
    assert len(errors) == 1 and "did not answer" in errors[0].read_text(), errors
    lost = 1 - int(errors[0].stem[-1])
    assert f"rank {lost} did not answer" in errors[0].read_text()
    latest = trainer_folders(tmp_path / "run").latest()
    assert latest is not None and latest.name == "checkpoint-3"
    assert trainer_folders(latest.parent).verify(latest) is None


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_then_ends_with_143_and_no_traceback(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "mixprec.cli.torchrun",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(WORKER),
        str(tmp_path),
    ]
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(cmd, env=_env({"ELASTIC_STEPS": "100000"}), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (tmp_path / "run" / "checkpoint-3").is_dir() and time.monotonic() < deadline:
                time.sleep(0.1)
            launcher.send_signal(signal.SIGTERM)  # what a scheduler does to preempt the job
            rc = launcher.wait(timeout=120)
        finally:
            launcher.kill()
    text = (tmp_path / "launcher.log").read_text()
    assert rc == 143, text[-3000:]
    assert "Traceback" not in text and "stopped by signal 15 at step" in text
    stopped_at = int(text.split("stopped by signal 15 at step ")[1].split(";")[0])
    latest = trainer_folders(tmp_path / "run").latest()  # the checkpoint taken at the stop, complete
    assert latest is not None and trainer_folders(latest.parent).number_of(latest) == stopped_at
    assert trainer_folders(latest.parent).verify(latest) is None


def test_mixprec_train_on_several_nodes_needs_a_shared_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.cli.main import main

    monkeypatch.chdir(tmp_path)
    # what torchrun --nnodes=2 --nproc_per_node=1 tells each worker; no group is joined before the check
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert main(["train", "--model", "tiny", "--max-steps", "1"]) == 2
    assert "pass --output-dir" in capsys.readouterr().err


def test_several_nodes_restarting_on_torchruns_shared_store_are_warned(caplog: pytest.LogCaptureFixture) -> None:
    from mixprec.strategies import peers

    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    server = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), is_master=True, wait_for_workers=False)
    with caplog.at_level("WARNING", logger="mixprec.accelerator"):
        assert peers.launcher_store(peers.timeout_delta(5), env) is not None
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
        caplog.clear()
        peers.launcher_store(peers.timeout_delta(5), {**env, "GROUP_WORLD_SIZE": "1"})  # one node: no warning
        assert caplog.text == ""
    del server
