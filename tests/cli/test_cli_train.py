"""`mixprec train` end to end on a tiny corpus: the run folder, the summary, --resume, --config, bad input.

Every run here uses the tiny GPT, 32-byte sequences and a handful of steps, in fp32 (which skips the "auto"
probe) except the one fp16 run that checks the loss-scale plot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.cli._config_file import load_config_file
from mixprec.cli.main import main

# an epoch of 256 tokens = 8 chunks of 32 = 2 steps of batch 4
FAST = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--epoch-tokens", "256", "--precision", "fp32"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("quick_train_cli")  # conftest.py: tmp_path as cwd, a short sample, one thread


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_the_run_folder_and_prints_the_summary(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", corpus, *FAST, "--epochs", "2", "--output-dir", str(run)]) == 0
    out = capsys.readouterr().out

    assert "mixprec train: summary" in out
    for row in ("precision", "steps", "loss scale", "train loss", "validation loss", "unigram baseline"):
        assert f"\n{row} " in out, row
    assert "fp32: fp32 was asked for" in out
    assert "4 (2 epochs), 0 skipped" in out
    assert "tokens/s" in out and "peak memory" in out and "MiB" in out
    sample = out.split("sample from the trained model (prompt 'def ', temperature 0.8):\n")[1]
    assert sample.startswith("def ") and len(sample.rstrip("\n")) >= 4 + 24 - 4  # bytes may merge into characters

    # one evaluation per epoch (2 steps each), on the held-out split
    evals = [e for e in _metrics(run) if "eval_loss" in e]
    assert [e["step"] for e in evals] == [2, 4]
    assert any("loss" in e and "eval_loss" not in e for e in _metrics(run))

    config = load_config_file(run / "config.toml")
    assert config["model"] == "tiny" and config["seq-len"] == 32 and config["epochs"] == 2
    assert config["data"] == str(Path(corpus).resolve())
    record = json.loads((run / "run.json").read_text())
    assert record["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    assert record["training_arguments"]["precision"] == "fp32"
    assert record["summary"]["global_step"] == 4

    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    assert checkpoints[-1] == "checkpoint-4"
    assert (run / "checkpoint-4" / "model.safetensors").stat().st_size > 0
    png = (run / "loss_curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert json.loads((run / "train_summary.json").read_text())["skipped_steps"] == 0

    # the same folder again without --resume: refused, the run is left as it was
    assert main(["train", "--data", corpus, *FAST, "--output-dir", str(run)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.name for p in run.glob("checkpoint-*")) == checkpoints


def test_resume_continues_from_the_last_checkpoint_with_the_runs_own_flags(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    # stops one step into the second epoch; the epoch-end save then writes checkpoint-3
    assert main(["train", "--data", corpus, *FAST, "--max-steps", "3", "--output-dir", str(run)]) == 0
    assert (run / "checkpoint-3").is_dir()
    capsys.readouterr()

    # no --model/--seq-len/--data: the run's config.toml supplies them; --max-steps is typed and wins
    assert main(["train", "--resume", str(run), "--max-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "resuming from checkpoint-3" in out
    assert "4 (2 epochs), 0 skipped" in out
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    # the evaluations of both invocations, each once: the epoch end at 2, the stop at 3, the epoch end at 4
    assert [e["step"] for e in _metrics(run) if "eval_loss" in e] == [2, 3, 4]
    assert load_config_file(run / "config.toml")["model"] == "tiny"


def test_resume_with_more_epochs_after_a_finished_run(tmp_path, corpus, capsys):
    # a run whose last step ends an epoch, extended by resuming with more epochs (was a loader-position bug)
    run = tmp_path / "run"
    one_step_epochs = ["--epoch-tokens", "128"]  # 4 chunks of 32: one step of batch 4
    assert main(["train", "--data", corpus, *FAST, *one_step_epochs, "--epochs", "1", "--output-dir", str(run)]) == 0
    assert main(["train", "--resume", str(run), "--epochs", "2"]) == 0
    assert "2 (2 epochs)" in capsys.readouterr().out


def test_resume_at_or_past_the_runs_end_trains_nothing_and_keeps_its_files(tmp_path, corpus, capsys):
    # --max-steps below the steps done trained one step more (step 5 of 2) and pruned a good checkpoint; a
    # finished run resumed overwrote train_summary.json and run.json with NaN and zero figures
    run = tmp_path / "run"
    assert main(["train", "--data", corpus, *FAST, "--max-steps", "4", "--output-dir", str(run)]) == 0
    kept = {name: (run / name).read_text() for name in ("train_summary.json", "run.json", "config.toml")}
    folders = sorted(p.name for p in run.glob("checkpoint-*"))
    capsys.readouterr()
    for more in (["--max-steps", "2"], ["--max-steps", "4"]):
        assert main(["train", "--resume", str(run), *more]) == 0
        assert "nothing to train: resumed at step 4" in capsys.readouterr().err
        assert sorted(p.name for p in run.glob("checkpoint-*")) == folders
        assert {name: (run / name).read_text() for name in kept} == kept


def test_a_precision_named_on_resume_replaces_the_saved_one_and_its_fp32_ops(tmp_path, corpus, capsys):
    # the saved --fp32-ops attention joined (or was refused beside) the precision typed on the resume
    run = tmp_path / "run"
    flags = [*FAST[:-2], "--precision", "bf16", "--fp32-ops", "attention", "--max-steps", "2"]
    assert main(["train", "--data", corpus, *flags, "--output-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--precision", "fp32", "--max-steps", "3"]) == 0
    assert re.search(r"^precision +fp32", capsys.readouterr().out, re.MULTILINE)
    assert main(["train", "--resume", str(run), "--precision", "fp16:fp32_ops=norm", "--max-steps", "4"]) == 0
    assert re.search(r"^precision +fp16:fp32_ops=norm", capsys.readouterr().out, re.MULTILINE)


def test_a_run_whose_losses_went_non_finite_writes_strict_json_and_counts_them(tmp_path, corpus, capsys):
    # run.json held "eval_loss": NaN, which strict readers refuse, and the summary said "the mean over the 6
    # steps" where 1 loss was finite
    run = tmp_path / "run"
    assert main(["train", "--data", corpus, *FAST, "--lr", "1e9", "--max-steps", "6", "--output-dir", str(run)]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    for name in ("run.json", "train_summary.json"):
        json.loads((run / name).read_text(), parse_constant=refuse)
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["train_loss_left_out"] >= 1
    assert f"{summary['train_loss_left_out']} non-finite losses left out" in capsys.readouterr().out


def test_config_file_sets_the_flags_and_the_command_line_overrides_it(tmp_path, corpus):
    cfg = tmp_path / "train.toml"
    cfg.write_text(
        f'data = "{corpus}"\nmodel = "tiny"\nseq_len = 32\nbatch-size = 8\nprecision = "fp32"\n'
        "max-steps = 2\nepoch-tokens = 256\nlr = 0.001\n"
    )
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--batch-size", "4", "--output-dir", str(run)]) == 0
    record = json.loads((run / "run.json").read_text())
    assert record["flags"]["batch_size"] == 4  # typed: beats the file's 8
    assert record["flags"]["lr"] == 0.001 and record["flags"]["max_steps"] == 2
    assert record["training_arguments"]["per_device_train_batch_size"] == 4
    assert record["summary"]["global_step"] == 2


def test_a_local_hugging_face_config_trains(tmp_path, corpus, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    cfg.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    argv = ["--model", str(tmp_path / "hf"), *FAST[2:], "--max-steps", "2", "--output-dir", str(run)]
    assert main(["train", "--data", corpus, *argv]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face GPT2LMHeadModel" in out and "initialised from its config" in out
    assert "2 (1 epochs), 0 skipped" in out
    assert (run / "checkpoint-2" / "model.safetensors").is_file()


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad_cfg = tmp_path / "bad.toml"
    bad_cfg.write_text("bach-size = 8\n")
    return {
        "unknown precision": (["--precision", "fp17"], "unknown precision 'fp17'; choose one of: no, fp32, fp16, bf16"),
        "missing data": (["--data", str(tmp_path / "nope.txt")], "no such file"),
        "empty corpus": (["--data", str(empty)], "empty"),
        "seq-len too long": (["--model", "tiny", "--seq-len", "65"], "block size 64"),
        "bad config key": (["--config", str(bad_cfg)], "unknown key 'bach-size'"),
        "unknown model": (["--model", "gpt-17"], "not a built-in model"),
        "missing resume": (["--resume", str(tmp_path / "no-run")], "no such run"),
        "step in backward with fp16": (["--step-in-backward", "--precision", "fp16"], "fp16's loss scaling skips"),
        "checkpointing with a policy": (
            ["--gradient-checkpointing", "--precision", "bf16", "--fp32-ops", "attention"],
            "--gradient-checkpointing with --precision bf16:fp32_ops=attention: the recompute in backward",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown precision",
        "missing data",
        "empty corpus",
        "seq-len too long",
        "bad config key",
        "unknown model",
        "missing resume",
        "step in backward with fp16",
        "checkpointing with a policy",
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(tmp_path, capsys, case):
    argv, fragment = _bad_inputs(tmp_path)[case]
    assert main(["train", *argv]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("mixprec train: error: ") and fragment in lines[0]
    assert "Traceback" not in captured.err
    assert not (tmp_path / "runs").exists()  # nothing written for a run that never started


def test_step_in_backward_under_torchrun_is_refused_in_flags_before_any_process_starts_training(
    tmp_path, corpus, capsys, monkeypatch
):
    # it was refused by the Accelerator, in Python's words, after every process had loaded its model
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29999")  # what torchrun sets; nothing connects: refused before that
    assert main(["train", "--data", corpus, *FAST, "--step-in-backward", "--output-dir", str(tmp_path / "r")]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert line.startswith("mixprec train: error: --step-in-backward with 2 processes: gradients are averaged")


def test_step_in_backward_trains_without_clipping_and_says_so(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    argv = ["train", "--data", corpus, *FAST, "--max-steps", "3", "--step-in-backward", "--output-dir", str(run)]
    assert main(argv) == 0
    assert "optimizer steps in backward" in capsys.readouterr().err
    arguments = json.loads((run / "run.json").read_text())["training_arguments"]
    assert arguments["step_in_backward"] is True and arguments["max_grad_norm"] is None


def test_step_in_backward_under_the_default_auto_races_without_fp16(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    flags = [f for f in FAST if f not in ("--precision", "fp32")]  # the default precision: auto
    assert (
        main(["train", "--data", corpus, *flags, "--max-steps", "20", "--step-in-backward", "--output-dir", str(run)])
        == 0
    )
    assert "fp16 excluded: step_in_backward=True: its loss scaling needs every gradient" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--batch-size", "0"], "argument --batch-size: expected a positive integer, got 0"),
        # the watch's errors named TrainingArguments(precision_watch=...), once the model had loaded
        (["--watch", "-3"], "argument --watch: the interval must be >= 1 step"),
        (["--watch", "fallback:x"], "argument --watch: 'fallback:x' is not a watch setting"),
    ],
)
def test_a_bad_flag_value_is_an_argparse_error(capsys, argv, said):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err


@pytest.mark.distributed
def test_torchrun_trains_on_two_processes_into_one_run_folder(tmp_path, corpus):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    argv = ["-m", "mixprec.cli.main", "train", "--data", corpus, *FAST, "--max-steps", "2"]
    proc = subprocess.run([*launch, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    # both processes exit 0, including the one that finishes first: it used to abort at interpreter exit 3 runs
    # in 30 (SIGABRT, "terminate called without an active exception": see mixprec.strategies.process_group)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    # no --output-dir: both processes must still agree on one runs/<launch time> folder
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "checkpoint-2").is_dir() and (runs[0] / "run.json").is_file()
    assert proc.stdout.count("mixprec train: summary") == 1  # printed by the main process only
    assert "tokens/s (all 2 processes together)" in proc.stdout


@pytest.mark.distributed
def test_a_run_resumed_by_more_processes_trains_its_last_epochs(tmp_path, corpus, capsys):
    # saved by 1 process (2 steps an epoch, 4 in all), resumed at checkpoint-2 by 2 (1 step an epoch): it said
    # "nothing to train" (max_steps 2 at the new world size) and exited 0 with the last epoch never trained
    run = tmp_path / "run"
    assert main(["train", "--data", corpus, *FAST, "--epochs", "2", "--output-dir", str(run)]) == 0
    shutil.rmtree(run / "checkpoint-4")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    argv = ["-m", "mixprec.cli.main", "train", "--resume", str(run)]
    proc = subprocess.run([*launch, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to train" not in proc.stderr
    assert "checkpoint-2 was saved by 1 process and resumes with 2: the run keeps its step count" in proc.stderr
    assert "4 (3 epochs), 0 skipped" in proc.stdout  # 1 epoch of 2 steps, then steps 3 and 4: an epoch each
    assert json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


def _console_script() -> Path:
    exe = Path(sys.executable).with_name("mixprec")
    if not exe.exists():
        pytest.skip("the mixprec console script is not installed next to this Python")
    return exe


def test_console_script_diagnoses_then_trains_in_fp16_with_a_loss_scale_plot(tmp_path, corpus):
    run = tmp_path / "run"
    argv = [*FAST[:-1], "fp16", "--diagnose", "--data", corpus, "--max-steps", "3", "--output-dir", str(run)]
    proc = subprocess.run(
        [str(_console_script()), "train", *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\nprecision         fp16: fp16 was asked for" in proc.stdout
    assert "\nloss scale        " in proc.stdout and "at the end" in proc.stdout
    assert "\ndiagnosis         recommended " in proc.stdout
    assert [e["event"] for e in _metrics(run) if e.get("event") == "diagnosis"] == ["diagnosis"]
    png = (run / "loss_scale.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert "Traceback" not in proc.stderr


def test_console_script_bad_input_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [str(_console_script()), "train", "--precision", "fp17"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mixprec train: error: --precision: unknown precision 'fp17'; choose one of: no, fp32,")
    assert line.endswith(", auto")


def test_z_loss_flag_adds_the_term_to_the_built_in_gpts_loss(tmp_path, corpus, capsys):
    """--z-loss (issue 26): the same run with the z-loss logs a larger first loss (the term is >= 0 and, at
    initialisation, log Z is about log(vocab) > 0); a weight out of [0, 1) is one line naming the flag."""
    first = {}
    for weight in ("0", "0.5"):
        run = tmp_path / f"z{weight}"
        argv = ["train", "--data", corpus, *FAST, "--max-steps", "1", "--output-dir", str(run), "--z-loss", weight]
        assert main(argv) == 0
        first[weight] = next(e["loss"] for e in _metrics(run) if "loss" in e)
    assert first["0.5"] > first["0"] + 1.0  # 0.5 * (log 256)^2 ~ 15: far past any noise
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--data", corpus, *FAST, "--z-loss", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--z-loss" in err[0]


def test_comm_dtype_is_shown_beside_the_precision(tmp_path, corpus, capsys):
    # issue 34: --comm-dtype was recorded only in config.toml; in one process it does nothing, said so
    run = tmp_path / "run"
    assert (
        main(["train", "--data", corpus, *FAST, "--max-steps", "1", "--comm-dtype", "bf16", "--output-dir", str(run)])
        == 0
    )
    captured = capsys.readouterr()
    said = "comm_dtype bf16 unused (one process: no gradients travel)"
    header = next(line for line in captured.err.splitlines() if line.startswith("mixprec: fp32 on cpu"))
    assert said in header and f"fp32: fp32 was asked for; {said}" in captured.out
    assert json.loads((run / "train_summary.json").read_text())["comm"] == said


@pytest.mark.parametrize("precision", ["bf16-pure", "bf16-pure-kahan"])
def test_an_optimizer_the_pure_mode_cannot_step_is_refused_in_flags(tmp_path, capsys, precision):
    # issue 34: refused with Python advice ("pass torch.optim.AdamW or Adam") on a command line
    argv = [
        "train",
        "--model",
        "tiny",
        "--precision",
        precision,
        "--optim",
        "adamw_anyprecision",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mixprec train: error:")]
    assert line.startswith(f"mixprec train: error: --precision {precision} --optim adamw_anyprecision: ")
    assert "use --optim adamw_torch or adamw_torch_fused" in line and "--precision bf16 to keep" in line
    assert "torch.optim" not in line and "precision='" not in line
    assert not (tmp_path / "run").exists()  # refused before anything was written
