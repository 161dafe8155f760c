"""Soak test of checkpoints (issue 14): random SIGKILLs during save-every-step training, and random byte
flips in the newest checkpoint. Every run must resume, bit-identical to the uninterrupted run.

- kill trials: a child process (forked from this one after torch is imported, so a trial costs no import)
  trains MAX_STEPS steps with a checkpoint after every step (save_total_limit 2, so pruning is under fire
  too) and is SIGKILLed at a uniformly random instant of its run. This process then resumes the folder
  (``resume_from_checkpoint=True``, or a fresh start if the kill came before the first checkpoint), trains
  to the end and compares every parameter, bit for bit, with the uninterrupted run. It also checks that no
  ``checkpoint-N`` folder the kill left fails its manifest (a kill never leaves a damaged checkpoint).
- flip trials: the uninterrupted run's checkpoints 1..k (k random) are copied into a fresh folder, one
  random byte of one random file of checkpoint-k (the newest) is XORed with a random non-zero mask, and the
  run is resumed: it must skip checkpoint-k, say why, resume from checkpoint-(k-1), and end bit-identical.

    python -m benchmarks.soak_checkpoints                        # 100 kills + 20 flips (a few minutes)
    python -m benchmarks.soak_checkpoints --kills 10 --flips 5   # a quick look
    python -m benchmarks.soak_checkpoints --precision fp32 --seed 3 --json soak.json
    python -m benchmarks.soak_checkpoints --async-save           # the same, checkpoints written in the background

Exit status 0 when every trial passed, 1 otherwise (each failure is printed).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, so forking after import is safe

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mixprec import Trainer, TrainingArguments  # noqa: E402
from mixprec.checkpoint import verify_manifest  # noqa: E402
from mixprec.checkpoint.folders import trainer_folders  # noqa: E402

MAX_STEPS = 12
ASYNC_SAVE = False  # --async-save: every checkpoint written by the background writer (TrainingArguments(async_save))
VOCAB, SEQ, WIDTH = 16, 8, 32


class DropLM(torch.nn.Module):
    """Embedding -> Linear -> GELU -> Dropout -> Linear: dropout makes an inexact RNG restore visible."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.dropout(F.gelu(self.hidden(self.embed(input_ids))), p=0.1, training=self.training)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1)), "logits": logits}


def examples(n: int = 20) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": (row + 1) % VOCAB} for row in ids]


def trainer(out: Path, precision: str, **kwargs: object) -> Trainer:
    """MAX_STEPS steps over 2.4 epochs of 5 batches, a checkpoint after every step."""
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out),
        precision=precision,
        max_steps=MAX_STEPS,
        save_steps=1,
        logging_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        disable_tqdm=True,
        save_plots=False,
        seed=7,
        **{"async_save": ASYNC_SAVE, **kwargs},
    )
    return Trainer(DropLM(), args, train_dataset=examples())


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def finish(out: Path, precision: str) -> tuple[dict[str, torch.Tensor], str | None]:
    """Resume ``out`` to the end (fresh if there is no checkpoint); (final parameters, checkpoint used)."""
    start = trainer_folders(out).find_resumable().checkpoint
    with contextlib.redirect_stderr(io.StringIO()):  # the banner and summary of each resumed run
        t = trainer(out, precision, save_strategy="no")
        t.train(resume_from_checkpoint=True if start is not None else None)
    return params(t.model), start.name if start is not None else None


def child_train(out: Path, precision: str, ready: int) -> None:
    """In the forked child: train, never returning into the parent's code."""
    try:
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)  # the run's banner and summary; errors still reach stderr
        os.write(ready, b"1")
        trainer(out, precision, save_total_limit=2).train()
        os._exit(0)
    except BaseException:  # noqa: BLE001 - report and leave, whatever happened
        import traceback

        traceback.print_exc()
        os._exit(1)


def run_child(out: Path, precision: str, kill_after: float | None) -> tuple[float, int]:
    """Fork a child that trains into ``out``; SIGKILL it ``kill_after`` seconds after it started (None:
    let it finish). Returns (seconds it ran, its wait status)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child_train(out, precision, w)
    os.close(w)
    os.read(r, 1)  # started
    os.close(r)
    start = time.perf_counter()
    if kill_after is not None:
        deadline = start + kill_after
        while time.perf_counter() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return time.perf_counter() - start, status
            time.sleep(min(0.002, max(0.0, deadline - time.perf_counter())))
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return time.perf_counter() - start, status


def what_the_kill_left(out: Path) -> str:
    """Where the kill landed, judged from the folder: inside a save (a temporary or aside folder exists),
    between saves, before the first checkpoint, or after the run ended."""
    names = [p.name for p in out.iterdir()] if out.exists() else []
    if any(".tmp-" in n and n.startswith(".checkpoint-") for n in names):
        return "inside a save (staging folder present)"
    if any(n.endswith(".old") for n in names):
        return "between a save's two renames"
    if any(n.endswith(".deleting") for n in names):
        return "while pruning"
    if not any(trainer_folders(out).number_of(out / n) is not None for n in names):
        return "before the first checkpoint"
    return "between saves"


def kill_trials(base: Path, n: int, precision: str, reference: dict, duration: float, rng: random.Random) -> dict:
    results: Counter[str] = Counter()
    resumed_from: Counter[str] = Counter()
    failures = []
    finished_first = 0  # children that ended before their kill instant: not counted as kills
    i = 0
    while sum(results.values()) < n and i < 3 * n:
        i += 1
        out = base / f"kill-{i}"
        ran, status = run_child(out, precision, rng.uniform(0.0, duration))
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
            failures.append(f"kill {i}: the child failed on its own (exit {os.WEXITSTATUS(status)})")
            continue
        if not os.WIFSIGNALED(status):  # the calibration overestimated a run (a busy machine): shrink it
            finished_first += 1
            duration = min(duration, ran)
            shutil.rmtree(out, ignore_errors=True)
            continue
        where = what_the_kill_left(out)
        results[where] += 1
        damaged = [p.name for p in out.glob("checkpoint-*") if verify_manifest(p) is not None]
        final, start = finish(out, precision)
        resumed_from[start or "fresh start"] += 1
        if damaged:
            failures.append(f"kill {i} ({where}): left damaged checkpoints {damaged}")
        if not identical(final, reference):
            failures.append(f"kill {i} ({where}, after {ran:.3f}s): resumed from {start}, parameters differ")
        shutil.rmtree(out, ignore_errors=True)
    return {
        "kills": sum(results.values()),
        "children_that_finished_before_their_kill_instant": finished_first,
        "where": dict(results),
        "resumed_from": dict(resumed_from),
        "failures": failures,
    }


def flip_trials(base: Path, n: int, precision: str, full: Path, reference: dict, rng: random.Random) -> dict:
    victims: Counter[str] = Counter()
    failures = []
    for i in range(n):
        k = rng.randint(2, MAX_STEPS)
        out = base / f"flip-{i}"
        out.mkdir()
        for step in range(1, k + 1):
            shutil.copytree(full / f"checkpoint-{step}", out / f"checkpoint-{step}")
        newest = out / f"checkpoint-{k}"
        files = sorted(p for p in newest.iterdir() if p.is_file())
        victim = rng.choice(files)
        data = bytearray(victim.read_bytes())
        offset = rng.randrange(len(data))
        data[offset] ^= rng.randint(1, 255)
        victim.write_bytes(bytes(data))
        victims[victim.name] += 1
        found = trainer_folders(out).find_resumable()
        final, start = finish(out, precision)
        if found.checkpoint != out / f"checkpoint-{k - 1}" or [p.name for p, _ in found.skipped] != [newest.name]:
            failures.append(f"flip {i}: byte {offset} of {victim.name} in checkpoint-{k}: chose {start}")
        if not identical(final, reference):
            failures.append(f"flip {i}: byte {offset} of {victim.name} in checkpoint-{k}: parameters differ")
        shutil.rmtree(out, ignore_errors=True)
    return {"trials": n, "files_flipped": dict(victims), "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=100, help="SIGKILL trials (default 100)")
    parser.add_argument("--flips", type=int, default=20, help="byte-flip trials (default 20)")
    parser.add_argument("--trials", type=int, default=None, help="shorthand: this many kills and a fifth as many flips")
    parser.add_argument("--precision", default="fp16", help="fp16 (default: the scaler's state too), fp32, bf16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill instants and the flips")
    parser.add_argument("--dir", default=None, help="where the run folders go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--async-save", action="store_true", help="checkpoints written on the background thread")
    args = parser.parse_args()
    global ASYNC_SAVE
    ASYNC_SAVE = args.async_save
    if args.trials is not None:
        args.kills, args.flips = args.trials, max(1, args.trials // 5)
    torch.set_num_threads(1)
    logging.getLogger("mixprec").setLevel(logging.ERROR)  # the skips are expected; the trials check them
    rng = random.Random(args.seed)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(tmp)
        full = trainer(base / "reference", args.precision)
        full.train()
        reference = params(full.model)
        durations = [run_child(base / f"calibrate-{i}", args.precision, None)[0] for i in range(3)]
        duration = sorted(durations)[1]  # a kill instant is uniform over a typical whole run
        kills = kill_trials(base, args.kills, args.precision, reference, duration, rng)
        flips = flip_trials(base, args.flips, args.precision, base / "reference", reference, rng)
    report = {
        "precision": args.precision,
        "async_save": args.async_save,
        "max_steps": MAX_STEPS,
        "child_run_seconds": round(duration, 3),
        "kills": kills,
        "flips": flips,
        "passed": not kills["failures"] and not flips["failures"],
        "wall_seconds": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
