"""Every combination holds (issue 34): precisions x levels x features, a few steps of a tiny model per cell.

Precisions: fp32, fp16, bf16, bf16-pure, bf16-pure-kahan, the per-op policy "bf16:fp32_ops=attention", and
"auto" raced as the run's own steps (``MIXPREC_AUTO_RACE=in-run``) and aside (``aside``): 8.
Levels: a plain GradScaler loop (the precision object's autocast, scaler and conversions), the Accelerator,
the Trainer, the command line (``mixprec train --model tiny``): 4.
Features: the precision watch, capsule + replay, resume, comm dtype under 2 processes
(test_combinations_comm.py), LoRA, HfArgumentParser, z-loss, and a planted non-finite gradient (a skipped step).

Not every triple: a covering design. Each precision meets each level, and each feature at one level at least:

- GradScaler loop: a planted skip (both "auto" cells: refused at the edge, the line asserted)
- Accelerator: capsule + replay (with the watch and a planted skip), resume, LoRA
- Trainer: watch (with a planted skip), HfArgumentParser, z-loss, resume (not for the in-run race: a
  checkpoint taken while it races resumes by racing again, by design, so no bit-identical twin exists)
- command line: one feature per precision (CLI_FEATURE), and the step in backward with a resume for every
  precision but fp16 (refused: its loss scaling needs every gradient first)

That is 8 + 24 + 31 + 8 + 7 = 78 cells here, 8 in test_combinations_comm.py (each precision with one comm dtype, two
processes, one launch), and 7 that cannot combine (REFUSED: 6 on the command line, 1 at the Accelerator),
refused at the edge with one line naming the argument and the fix: 93 cells in all, about 50 s on 2 busy cores.

The invariants every cell checks (combo_checks.py, each its own AssertionError kind, so an expected failure
names the one invariant a known defect breaks): no warning, log record or printed line names a 16-bit format
the run does not compute in; a resumed run's weights are bit-identical to the uninterrupted run's; a reported
figure matches the metrics file; nothing is written outside the run folder (cwd, HOME, cache and temp folders
are the cell's own); a skipped step leaves weights, moments, the schedule and the counters as a skip should.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from combo_checks import (
    FigureMismatch,
    Findings,
    ResumeDiffers,
    Sandbox,
    SkipLeaked,
    differing,
    listening,
)
from combo_levels import (
    RACES,
    accelerator_lora,
    accelerator_resume,
    accelerator_skip_capsule,
    precision_name,
    scaler_loop,
    set_race,
    trainer_hf_parser,
    trainer_resume,
    trainer_watch,
    trainer_z_loss,
)

from mixprec.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")
# matplotlib builds its font cache under HOME on its first import: its own first-run cost, not a run's write
pytest.importorskip("matplotlib.pyplot")

PRECISIONS = [
    "fp32",
    "fp16",
    "bf16",
    "bf16-pure",
    "bf16-pure-kahan",
    "bf16:fp32_ops=attention",
    "auto-inrun",
    "auto-aside",
]
CLI_FEATURE = {
    "fp32": "resume",
    "fp16": "watch",
    "bf16": "z-loss",
    "bf16-pure": "lora",
    "bf16-pure-kahan": "resume",
    "bf16:fp32_ops=attention": "watch",
    "auto-inrun": "lora",
    "auto-aside": "resume",
}

# Known defects: each mark names the invariant it breaks (raises=...), so the cell still fails on anything
# else; strict, so a fix flips it to a failure to unmark. None is left.
KNOWN: dict[tuple[str, str, str], tuple[type[BaseException], str]] = {}


def _cells() -> list:
    cells = []
    for p in PRECISIONS:
        triples = [(p, "scaler", "skip")]
        triples += [(p, "accelerator", f) for f in ("capsule", "resume", "lora")]
        trainer = ("watch", "hf-parser", "z-loss") + (() if p == "auto-inrun" else ("resume",))
        triples += [(p, "trainer", f) for f in trainer]
        triples += [(p, "cli", CLI_FEATURE[p])]
        for t in triples:
            known = KNOWN.get(t)
            marks = [pytest.mark.xfail(strict=True, raises=known[0], reason=known[1])] if known else []
            cells.append(pytest.param(*t, id="-".join(t), marks=marks))
    return cells


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A tiny GPT-2 with its (fp32) weights saved, as a user's local model folder."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("precision", "level", "feature"), _cells())
def test_cell(precision, level, feature, tmp_path, monkeypatch, request, capsys):
    set_race(precision, monkeypatch)
    hf = request.getfixturevalue("hf_folder") if feature == "lora" else None
    corpus = request.getfixturevalue("corpus") if level == "cli" else None
    sandbox = Sandbox(tmp_path, monkeypatch)
    run = sandbox.cwd / "run"
    findings = Findings()
    with listening() as said:
        if level == "scaler":
            if precision in RACES:
                with pytest.raises(ValueError) as refused:
                    scaler_loop(precision, findings)
                assert str(refused.value).startswith("autocast('auto'): auto is measured on a training step; name")
            else:
                scaler_loop(precision, findings)
        elif level == "accelerator":
            if feature == "capsule":
                capsules = [Path(c).name for c in accelerator_skip_capsule(precision, run, findings, said)]
                findings.expect(capsules == ["step-00000003"], SkipLeaked, f"capsules {capsules}, planted at 3")
                if capsules:
                    assert main(["replay", str(run / "capsules" / capsules[0])]) == 0
            elif feature == "resume":
                accelerator_resume(precision, run, findings)
            else:
                accelerator_lora(precision, hf, findings)
        elif level == "trainer":
            {
                "watch": trainer_watch,
                "hf-parser": trainer_hf_parser,
                "z-loss": trainer_z_loss,
                "resume": trainer_resume,
            }[feature](precision, run, findings)
        else:
            cli_cell(precision, feature, run, corpus, hf, findings, said, capsys, monkeypatch)
    printed = capsys.readouterr()
    said.add_text(printed.out + printed.err)
    said.formats_named(precision, findings)
    sandbox.check([run, run.parent / f"{run.name}-resumed"], findings)
    findings.check()


# -- the command line ----------------------------------------------------------------------------------------

FAST = ["--seq-len", "32", "--batch-size", "4", "--epoch-tokens", "256"]


def cli_cell(precision, feature, run, corpus, hf_folder, findings, said, capsys, monkeypatch, flags=()) -> None:
    from mixprec.cli import train as train_cli

    monkeypatch.setattr(train_cli, "SAMPLE_BYTES", 8)  # the closing sample: a byte per forward pass
    if feature != "watch":  # the plots take half a cell's time: drawn (and their files checked) in the watch cells
        monkeypatch.setattr("mixprec.trainer.plots.plot_run", lambda *args, **kwargs: None)
    model = ["--model", hf_folder, "--lora-r", "4"] if feature == "lora" else ["--model", "tiny"]
    extra = {"watch": ["--watch", "1"], "z-loss": ["--z-loss", "0.01"]}.get(feature, [])
    argv = ["train", "--data", corpus, *model, *FAST, "--precision", precision_name(precision), *extra, *flags]
    assert main([*argv, "--epochs", "2", "--output-dir", str(run)]) == 0
    printed = capsys.readouterr()
    said.add_text(printed.out + printed.err)
    check_cli_figures(printed.out, run, findings)
    if feature != "resume":
        return
    # the crash after checkpoint-2: its folder, and the metrics file as far as that step
    again = run.parent / f"{run.name}-resumed"
    again.mkdir()
    shutil.copytree(run / "checkpoint-2", again / "checkpoint-2")
    shutil.copy(run / "config.toml", again / "config.toml")
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [e for e in events if e.get("step", 0) <= 2 and "train_loss" not in e]
    (again / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    assert main(["train", "--resume", str(again)]) == 0
    printed = capsys.readouterr()
    said.add_text(printed.out + printed.err)
    from safetensors.torch import load_file

    moved = differing(
        load_file(run / "checkpoint-4" / "model.safetensors"), load_file(again / "checkpoint-4" / "model.safetensors")
    )
    findings.expect(not moved, ResumeDiffers, f"{precision} command line resumed: {moved[:4]} differ")
    summary = check_cli_figures(printed.out, again, findings)
    findings.expect(
        summary["train_loss_steps"] == 2, FigureMismatch, f"resumed summary over {summary['train_loss_steps']} steps"
    )
    first = json.loads((run / "train_summary.json").read_text())
    findings.expect(
        summary["train_loss"] != first["train_loss"],
        FigureMismatch,
        f"the resumed run's loss {summary['train_loss']} is the whole 4-step run's mean",
    )


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "fp16"])  # fp16: REFUSED below
def test_step_in_backward_cell(precision, tmp_path, monkeypatch, request, capsys):
    """The step-in-backward axis: each precision that can update parameters during the backward does so on the
    command line, and a crash after checkpoint-2 resumes bit-identical (auto races without fp16)."""
    set_race(precision, monkeypatch)
    corpus = request.getfixturevalue("corpus")
    sandbox = Sandbox(tmp_path, monkeypatch)
    run = sandbox.cwd / "run"
    findings = Findings()
    with listening() as said:
        cli_cell(precision, "resume", run, corpus, None, findings, said, capsys, monkeypatch, ["--step-in-backward"])
    printed = capsys.readouterr()
    said.add_text(printed.out + printed.err)
    said.formats_named(precision, findings)
    sandbox.check([run, run.parent / f"{run.name}-resumed"], findings)
    findings.check()
    assert "step-in-backward = true" in (run / "config.toml").read_text()  # the resumed run read it back


def _row(out: str, name: str) -> str:
    match = re.search(rf"^{name} +(.*)$", out, re.MULTILINE)
    assert match, f"no {name!r} row in the summary:\n{out[-2000:]}"
    return match.group(1)


def check_cli_figures(out: str, run: Path, findings: Findings) -> dict:
    """The printed summary's steps, skipped steps, train loss and tokens/s are train_summary.json's, which are
    the metrics file's last summary entry."""
    summary = json.loads((run / "train_summary.json").read_text())
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in events if "train_loss" in e][-1]
    findings.expect(last["train_loss"] == summary["train_loss"], FigureMismatch, "train_loss: metrics vs summary")
    steps = _row(out, "steps")
    findings.expect(
        steps.startswith(f"{summary['global_step']} (") and steps.endswith(f", {summary['skipped_steps']} skipped"),
        FigureMismatch,
        f"printed steps {steps!r}, summary {summary['global_step']} / {summary['skipped_steps']} skipped",
    )
    loss = _row(out, "train loss")
    findings.expect(
        loss.startswith(f"{summary['train_loss']:.4f} "), FigureMismatch, f"printed {loss!r} vs {summary['train_loss']}"
    )
    speed = _row(out, "throughput")
    findings.expect(
        speed.startswith(f"{summary['train_tokens_per_second']:,.0f} tokens/s"),
        FigureMismatch,
        f"printed {speed!r} vs {summary['train_tokens_per_second']}",
    )
    return summary


# -- the cells that cannot combine: refused at the edge, one line naming the argument and the fix ------------

# (flags, what the one line must hold): each a real limitation, said in the comment
REFUSED = [
    # pure bf16 holds bf16 weights: an op kept in fp32 would need fp32 weights, which is what "bf16" keeps
    pytest.param(
        ["--model", "tiny", "--precision", "bf16-pure", "--fp32-ops", "attention"],
        ["--fp32-ops", "use precision='bf16' or 'fp16'"],
        id="bf16-pure-fp32-ops",
    ),
    # auto measures its own per-op policy; kinds named beside it would be overruled
    pytest.param(
        ["--model", "tiny", "--precision", "auto", "--fp32-ops", "attention"],
        ["--fp32-ops", "use precision='bf16' or 'fp16'"],
        id="auto-fp32-ops",
    ),
    # a Hugging Face model computes its own loss: the z-loss term is the built-in GPT's
    pytest.param(
        ["--model", "HF", "--precision", "bf16", "--z-loss", "0.01"],
        ["--z-loss", "drop --z-loss for --model"],
        id="z-loss-hf-model",
    ),
    # the adapters go on a frozen Hugging Face model (peft), not on the built-in GPT
    pytest.param(
        ["--model", "tiny", "--precision", "bf16", "--lora-r", "4"],
        ["--lora-r 4", "pass --model"],
        id="lora-built-in-gpt",
    ),
    # fp16's skip is decided after the whole backward; a parameter updated during it cannot be taken back
    pytest.param(
        ["--model", "tiny", "--precision", "fp16", "--step-in-backward"],
        ["--step-in-backward", "use bf16, bf16-pure or fp32"],
        id="fp16-step-in-backward",
    ),
    # pure bf16 steps with its own Adam (rounding the bf16 weights); another optimizer would round to nearest
    pytest.param(
        ["--model", "tiny", "--precision", "bf16-pure", "--optim", "adamw_anyprecision"],
        ["--optim", "adamw_torch"],
        id="bf16-pure-optim",
    ),
]


@pytest.mark.parametrize(("flags", "fragments"), REFUSED)
def test_refused_cell(flags, fragments, request, capsys, tmp_path, monkeypatch):
    corpus = request.getfixturevalue("corpus")
    if "HF" in flags:
        flags = [request.getfixturevalue("hf_folder") if f == "HF" else f for f in flags]
    sandbox = Sandbox(tmp_path, monkeypatch)
    capsys.readouterr()  # what making the fixtures printed
    argv = ["train", "--data", corpus, *FAST, "--max-steps", "2", "--output-dir", "run", *flags]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert all(f in err[0] for f in fragments), err[0]
    assert "Traceback" not in err[0]
    findings = Findings()
    sandbox.check([], findings)  # refused before anything is written
    findings.check()


def test_a_policy_on_pure_bf16_is_refused_by_the_accelerator_naming_fp32_ops():
    from mixprec import Accelerator

    needs = r"^Accelerator\(fp32_ops='attention'\): fp32_ops=\['attention'\] needs an autocast mode to refine"
    with pytest.raises(ValueError, match=needs) as refused:
        Accelerator(mixed_precision="bf16-pure", fp32_ops="attention", cpu=True, verbose=False)
    assert "use precision='bf16' or 'fp16'" in str(refused.value) and "\n" not in str(refused.value)
