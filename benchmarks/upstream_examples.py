"""transformers' and accelerate's own example scripts, run as written and with only their import switched to mixprec.

    python -m benchmarks.upstream_examples --transformers ~/src/transformers --accelerate ~/src/accelerate
    python -m benchmarks.upstream_examples ... --only nlp_example,run_clm --precisions bf16 --jobs 2

Each script in ``SCRIPTS`` runs from the checkout the user names (never copied into this project) in fp32,
fp16 and bf16 on the CPU, offline, a few steps on tiny local models and data (``_example_fixtures``), twice:
as written ("upstream"), and with ``from transformers import Trainer, TrainingArguments`` /
``from accelerate import Accelerator`` taken from mixprec instead ("mixprec": the switch a user makes; every
other import stays, so the script still uses transformers' models, datasets, logging and helpers). The
precision goes in as the script takes it: ``--fp16``/``--bf16`` for the Trainer scripts, ``--mixed_precision``
for accelerate's, and ``ACCELERATE_MIXED_PRECISION`` (what ``accelerate launch --mixed_precision`` sets) for
the transformers ``*_no_trainer`` scripts, which have no flag of their own.

The table's "computed in" is measured, not reported by either library: ``_example_probe`` counts the dtype
of every ``nn.Linear`` output in training forwards. "loss" is the first and the last training forward's loss.

Needs ``evaluate`` besides the test extra (``pip install evaluate``): the scripts import it. by_feature's
``cross_validation`` needs scikit-learn and ``schedule_free`` needs schedulefree; without them those rows fail
under both implementations. A script missing from a checkout is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.upstream_hf_trainer import OFFLINE, swap_imports

PRECISIONS = ("fp32", "fp16", "bf16")
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
PROBE = Path(__file__).with_name("_example_probe.py")


@dataclass(frozen=True)
class Script:
    """One upstream script: where it lives, what the user swaps, and how it is told the precision."""

    name: str
    repo: str  # "transformers" | "accelerate": which checkout ``path`` is in
    path: str
    swap: tuple[str, tuple[str, ...]]  # (module, names) a user moves to mixprec
    args: tuple[str, ...] = ()
    precision_by: str = "mixed_precision"  # "trainer" (--fp16/--bf16) | "mixed_precision" | "env"

    def precision_args(self, precision: str) -> tuple[list[str], dict[str, str]]:
        accelerate_name = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}[precision]
        if self.precision_by == "trainer":
            return ([] if precision == "fp32" else [f"--{precision}"]), {}
        if self.precision_by == "env":
            return [], {"ACCELERATE_MIXED_PRECISION": accelerate_name}
        return ["--mixed_precision", accelerate_name, "--cpu"], {}


TRAINER = ("transformers", ("Trainer", "TrainingArguments"))
ACCELERATOR = ("accelerate", ("Accelerator",))
# Few steps each: the Trainer scripts stop at --max_steps; accelerate's examples hard-code 3 epochs (2 in
# some), which on the 64-pair stand-in for MRPC at their batch size of 16 is 12 steps.
TRAINER_COMMON = ("--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_steps", "8")
TRAINER_COMMON += ("--logging_steps", "1", "--report_to", "none", "--seed", "42", "--output_dir", "{out}", "--use_cpu")
SCRIPTS = (
    Script(
        "run_clm",
        "transformers",
        "examples/pytorch/language-modeling/run_clm.py",
        TRAINER,
        ("--model_name_or_path", "tiny-gpt2", "--train_file", "text/train.txt", "--validation_file")
        + ("text/validation.txt", "--do_train", "--do_eval", "--block_size", "32", *TRAINER_COMMON),
        "trainer",
    ),
    Script(
        "run_glue",
        "transformers",
        "examples/pytorch/text-classification/run_glue.py",
        TRAINER,
        ("--model_name_or_path", "bert-base-cased", "--train_file", "pairs/train.csv", "--validation_file")
        + ("pairs/validation.csv", "--do_train", "--do_eval", "--max_seq_length", "64", *TRAINER_COMMON),
        "trainer",
    ),
    Script(
        "run_clm_no_trainer",
        "transformers",
        "examples/pytorch/language-modeling/run_clm_no_trainer.py",
        ACCELERATOR,
        ("--model_name_or_path", "tiny-gpt2", "--train_file", "text/train.txt", "--validation_file")
        + ("text/validation.txt", "--block_size", "32", "--per_device_train_batch_size", "4")
        + ("--per_device_eval_batch_size", "4", "--max_train_steps", "8", "--seed", "42", "--output_dir", "{out}"),
        "env",
    ),
    Script(
        "run_glue_no_trainer",
        "transformers",
        "examples/pytorch/text-classification/run_glue_no_trainer.py",
        ACCELERATOR,
        ("--model_name_or_path", "bert-base-cased", "--train_file", "pairs/train.csv", "--validation_file")
        + ("pairs/validation.csv", "--max_length", "64", "--per_device_train_batch_size", "4")
        + ("--per_device_eval_batch_size", "4", "--max_train_steps", "8", "--seed", "42", "--output_dir", "{out}"),
        "env",
    ),
    Script("nlp_example", "accelerate", "examples/nlp_example.py", ACCELERATOR),
    Script(
        "complete_nlp_example",
        "accelerate",
        "examples/complete_nlp_example.py",
        ACCELERATOR,
        ("--checkpointing_steps", "epoch", "--output_dir", "{out}"),
    ),
    *(
        Script(name, "accelerate", f"examples/by_feature/{name}.py", ACCELERATOR, args)
        for name, args in (
            ("automatic_gradient_accumulation", ()),
            ("checkpointing", ("--checkpointing_steps", "epoch", "--output_dir", "{out}")),
            ("cross_validation", ("--num_folds", "2")),
            ("ddp_comm_hook", ()),
            ("early_stopping", ()),
            ("gradient_accumulation", ("--gradient_accumulation_steps", "2")),
            ("local_sgd", ("--gradient_accumulation_steps", "1", "--local_sgd_steps", "2")),
            ("memory", ()),
            ("multi_process_metrics", ()),
            ("profiler", ("--output_trace_dir", "{out}")),
            ("schedule_free", ()),
            ("tracking", ("--with_tracking", "--project_dir", "{out}")),
        )
    ),
)
# accelerate examples left out, and why (printed under the table so the reader sees the whole folder).
NOT_RUN = {
    "by_feature/deepspeed_with_config_support.py": "needs DeepSpeed and a GPU",
    "by_feature/megatron_lm_gpt_pretraining.py": "needs Megatron-LM and GPUs",
    "by_feature/fsdp_with_peak_mem_tracking.py": "FSDP: needs a multi-process launch (accelerate launch)",
    "by_feature/gradient_accumulation_for_autoregressive_models.py": "hard-codes 500 samples x 3 epochs at batch 2"
    " (750 steps): not a few-step run",
    "cv_example.py, complete_cv_example.py": "need an image folder (Oxford pets)",
}
# Failures another branch of issue 22 owns: a row whose mixprec error matches is marked with the item.
KNOWN = {
    "unexpected keyword argument 'mixprec'": "item 1, HfArgumentParser (branch dropin)",
    "initialize the accelerate state": "item 1, accelerate's state (branch dropin)",
    "next_checkpoint": "item 1, ProjectConfiguration (branch dropin)",
    "expected a DataLoaderConfiguration": "item 1, DataLoaderConfiguration (branch dropin)",
    "kwargs_handlers": "item 1, kwargs handlers (branch dropin)",
    "mlflow": "item 3, mlflow (branch dropin)",
}


@dataclass
class Run:
    """One script in one precision under one implementation."""

    script: str
    precision: str
    impl: str
    rc: int | None = None  # None: timed out
    error: str = ""
    seconds: float = 0.0
    linear_dtypes: dict[str, int] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    stderr_tail: str = ""  # for --json: the last lines the script printed to stderr

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def result(self) -> str:
        if self.rc is None:
            return "timeout"
        return "ok" if self.ok else f"exit {self.rc}: {self.error}"

    def computed_in(self) -> str:
        """The dtype(s) the training matmuls ran in, e.g. "bf16" or "fp32 75% / bf16 25%"; "-" if none ran."""
        total = sum(self.linear_dtypes.values())
        if not total:
            return "-"
        ranked = sorted(self.linear_dtypes.items(), key=lambda kv: -kv[1])
        if len(ranked) == 1:
            return DTYPE_NAMES.get(ranked[0][0], ranked[0][0])
        return " / ".join(f"{DTYPE_NAMES.get(d, d)} {100 * n / total:.0f}%" for d, n in ranked)

    def loss(self) -> str:
        return f"{self.losses[0]:.4f} -> {self.losses[-1]:.4f}" if self.losses else "-"

    def known(self) -> str:
        return next((note for sig, note in KNOWN.items() if sig in self.error), "")


def last_error(stderr: str) -> str:
    """The exception line of a traceback (``TypeError: ...``), else the last non-empty line; one line, short."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b.*", ln)]
    line = (errors or lines or [""])[-1]
    return line if len(line) <= 160 else line[:157] + "..."


def stage(script: Script, checkouts: dict[str, Path], into: Path, impl: str) -> Path:
    """The file to run: the checkout's own for "upstream", a swapped copy under ``into`` for "mixprec"."""
    source = checkouts[script.repo] / script.path
    if impl == "upstream":
        return source
    module, names = script.swap
    text, moved = swap_imports(source.read_text(encoding="utf-8"), set(names), modules={module})
    if not moved:
        raise ValueError(f"{script.path}: no `from {module} import {', '.join(names)}` to switch")
    staged = into / "scripts" / script.path
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_text(text, encoding="utf-8")
    return staged


def run_one(script: Script, precision: str, impl: str, path: Path, work: Path, timeout: int) -> Run:
    """Run ``path`` in the fixtures folder ``work`` under the probe; what it did and how it ended."""
    run = Run(script.name, precision, impl)
    out = Path(tempfile.mkdtemp(prefix=f"{script.name}-{precision}-{impl}-", dir=work / "runs"))
    extra, env_extra = script.precision_args(precision)
    args = [a.replace("{out}", str(out / "output")) for a in script.args] + extra
    probe_out = out / "probe.json"
    # A stray ACCELERATE_MIXED_PRECISION from the caller's shell would override the asked precision.
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_MIXED_PRECISION"}
    env.update(OFFLINE, **env_extra, HF_HOME=str(work / "hf_home"), OMP_NUM_THREADS="1")
    # accelerate's log_with="all" (by_feature/tracking.py) takes every tracker installed; mlflow's default store
    # is a sqlite database that mlflow-skinny cannot open, under accelerate as under mixprec: a folder instead,
    # which mlflow 3 refuses unless told it is wanted.
    env.setdefault("MLFLOW_TRACKING_URI", (work / "mlruns").as_uri())
    env.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    cmd = [sys.executable, str(PROBE), str(probe_out), str(path), *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, timeout=timeout, capture_output=True, text=True)
        run.rc = proc.returncode
        run.error = "" if proc.returncode == 0 else last_error(proc.stderr)
        run.stderr_tail = "\n".join(proc.stderr.splitlines()[-40:])
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {timeout} s"
    run.seconds = time.perf_counter() - start
    if probe_out.is_file():
        report = json.loads(probe_out.read_text())
        run.linear_dtypes, run.losses = report["linear_dtypes"], report["losses"]
    return run


def table(runs: list[Run]) -> str:
    """A markdown table, one row per (script, precision), upstream and mixprec side by side."""
    by_key = {(r.script, r.precision, r.impl): r for r in runs}
    rows = [
        "| script | precision | upstream | mixprec | computed in (upstream / mixprec) | loss first -> last, upstream"
        " | loss first -> last, mixprec | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = dict.fromkeys((r.script, r.precision) for r in runs)
    for name, precision in keys:
        up, mp = by_key.get((name, precision, "upstream")), by_key.get((name, precision, "mixprec"))
        cells = [name, precision]
        cells += [r.result().replace("|", "\\|") if r else "not run" for r in (up, mp)]
        cells.append(" / ".join(r.computed_in() if r else "-" for r in (up, mp)))
        cells += [r.loss() if r else "-" for r in (up, mp)]
        notes = []
        if mp and mp.ok and mp.computed_in() != precision:
            notes.append(f"**mixprec computed in {mp.computed_in()}, asked {precision}**")
        if up and up.ok and up.computed_in() != precision:
            notes.append(f"upstream ran {up.computed_in()} when asked {precision}")
        if mp and mp.known() and not (up and not up.ok):  # a failure under both is not the other branch's
            notes.append(mp.known())
        cells.append("; ".join(notes))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", type=Path, required=True, help="a transformers checkout (its examples/)")
    parser.add_argument("--accelerate", type=Path, required=True, help="an accelerate checkout (its examples/)")
    parser.add_argument("--only", default="", help="comma-separated script names (default: all of SCRIPTS)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated, of fp32,fp16,bf16")
    parser.add_argument("--impl", choices=("both", "upstream", "mixprec"), default="both")
    parser.add_argument("--jobs", type=int, default=2, help="scripts run at once (each on one thread)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every run's record here")
    args = parser.parse_args(argv)
    checkouts = {"transformers": args.transformers, "accelerate": args.accelerate}
    wanted = [s for s in args.only.split(",") if s]
    unknown = sorted(set(wanted) - {s.name for s in SCRIPTS})
    if unknown:
        names = ", ".join(s.name for s in SCRIPTS)
        parser.error(f"--only: unknown script(s) {', '.join(unknown)}; choose from {names}")
    precisions = [p for p in args.precisions.split(",") if p]
    if set(precisions) - set(PRECISIONS):
        parser.error(f"--precisions {args.precisions}: choose from {', '.join(PRECISIONS)}")
    scripts = [s for s in SCRIPTS if not wanted or s.name in wanted]
    for s in [s for s in scripts if not (checkouts[s.repo] / s.path).is_file()]:
        print(f"skipped {s.name}: --{s.repo} {checkouts[s.repo]} has no {s.path}", file=sys.stderr)
    scripts = [s for s in scripts if (checkouts[s.repo] / s.path).is_file()]
    impls = ("upstream", "mixprec") if args.impl == "both" else (args.impl,)

    from benchmarks._example_fixtures import write_fixtures

    with tempfile.TemporaryDirectory(prefix="upstream_examples_") as tmp:
        work = write_fixtures(Path(tmp))
        (work / "runs").mkdir()
        jobs = [(s, p, i, stage(s, checkouts, work, i)) for s in scripts for p in precisions for i in impls]
        start = time.perf_counter()
        done: list[Run] = []

        def one(job: tuple) -> Run:
            run = run_one(*job, work, args.timeout)
            done.append(run)  # list.append is atomic: the progress count needs no lock
            print(
                f"[{len(done)}/{len(jobs)}] {run.script} {run.precision} {run.impl}: {run.result()}"
                f" ({run.seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            return run

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(one, jobs))
        wall = time.perf_counter() - start
    print(table(runs))
    print(f"\n{len(runs)} runs in {wall:.0f} s wall ({args.jobs} at once).")
    for name, why in NOT_RUN.items():
        print(f"not run: accelerate examples/{name}: {why}")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
