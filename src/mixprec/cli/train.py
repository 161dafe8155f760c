"""``mixprec train``: train a model with the Trainer and report what precision did to the run.

With no arguments it trains the built-in "small" GPT on the embedded corpus (this Python's standard library
source, read as bytes; nothing is downloaded) under precision "auto", evaluating on the held-out tail of the
corpus every epoch, and ends with a summary table, a run folder and a short generated sample. Everything is
the Trainer's work (`mixprec.trainer`): this file turns flags into TrainingArguments and prints.

Under ``torchrun --nproc_per_node=N`` the same command trains on N processes; only the main one prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.cli import _rundir, _summary_table, _threads
from mixprec.cli._common import (
    DataModelInfo,
    add_data_model_args,
    check_optimizer_fits,
    check_step_in_backward,
    load_model_and_data,
    nonnegative_int,
    parse_precision,
    positive_float,
    positive_int,
    watch_setting,
    z_loss_weight,
)
from mixprec.cli._config_file import add_config_arg, apply_config
from mixprec.cli._epochs import EpochCallback, EpochChunks
from mixprec.cli._evaluation import eval_batch_for, eval_subset, subset_tokens
from mixprec.cli._lora import add_lora_args, apply_lora, lora_plan
from mixprec.cli._subcommand import Subcommand
from mixprec.cli.main import CliError
from mixprec.data import decode, encode, unigram_entropy
from mixprec.models import GPT, GPT_PRESETS
from mixprec.precision.base import Precision
from mixprec.strategies.comm import COMM_NAMES
from mixprec.strategies.launch_env import LaunchEnv
from mixprec.strategies.restarts import restarted_anywhere, restarted_by_launcher, restarts_allowed_on_several_nodes
from mixprec.trainer.optimizers import OPTIMIZER_NAMES
from mixprec.trainer.signals import TrainingInterrupted
from mixprec.tree import strict_json

# -- defaults, measured on the project's 2-core AMD EPYC (AVX2) machine, where "auto" picks fp32 ------------
# 300 steps of 16 x 128 bytes (614K bytes: a fifth of the training split, so no chunk is seen twice) bring the
# small GPT's validation loss to 2.27 nats/byte against a unigram baseline of 3.11 in about 3.5 minutes, with
# evaluation, on one core of this shared machine. 16 x 256 bytes reached only 2.33 in the same 300 steps at
# 2.4x the time (and there lr 2e-3 and 3e-3 ended equal). Timings shift with the machine's load: with two
# torch threads and any other busy process a step is 2-3x slower than with OMP_NUM_THREADS=1.
DEFAULT_EPOCHS = 3
DEFAULT_BATCH_SIZE = 16
DEFAULT_SEQ_LEN = 128
DEFAULT_EPOCH_TOKENS = 100 * DEFAULT_BATCH_SIZE * DEFAULT_SEQ_LEN
"""Tokens per epoch: 100 steps of the default batch, so the default run evaluates 3 times."""
DEFAULT_LR = 3e-3
"""Peak of the warmup + cosine schedule; a 0.9M-parameter model takes a higher rate than nanoGPT's 1e-3 at 10M."""
SAMPLE_PROMPT = "def "
SAMPLE_BYTES = 200
"""Bytes sampled after the prompt, capped so the sample stays within the positions the model trained on."""

EPILOG = """\
examples:
  mixprec train                                   built-in small GPT, embedded corpus, precision auto
  mixprec train --precision fp16 --max-steps 50   really fp16 (autocast + loss scaling), on a CPU too
  mixprec train --model tiny --epochs 1 --seq-len 64 --output-dir runs/tiny
  mixprec train --data notes.txt --epochs 5       your own text: a file, a folder, or .jsonl
  mixprec train --resume runs/tiny --epochs 2     continue a run from its last checkpoint
  mixprec train --config train.toml --lr 1e-3     flags from a file; the command line wins
  mixprec train --diagnose --precision fp16       diagnose gradient ranges first, start at the advised scale
  mixprec train --precision fp16 --watch 20       per-layer headroom every 20 steps, warnings, skip tracing
  mixprec train --precision bf16 --optim adamw_torch_8bit   8-bit Adam states (pip install "mixprec[lean]")
  mixprec train --model gpt2 --compile --seq-len 1024 --batch-size 16 --max-steps 200   GPT-2 124M on a GPU
  mixprec train --model gpt-1b --compile --seq-len 1024 --batch-size 8 --max-steps 100  0.91B GPT on a GPU
  mixprec train --model path/to/hf-model --lora-r 8 --precision bf16   LoRA on a frozen bf16 base (needs peft)
  torchrun --nproc_per_node=2 -m mixprec.cli.main train --output-dir runs/ddp
  mixprec torchrun --nproc-per-node 2 -m mixprec.cli.main train --comm-dtype bf16   gradients sent in bf16

an epoch is --epoch-tokens tokens of new chunks drawn from the training split (the whole split if it is
smaller); the run evaluates on the held-out last 10% of the corpus at the end of every epoch.

config file (TOML, or YAML with pyyaml): flag names as keys, e.g.
  precision = "fp16"
  max-steps = 200
  seq-len = 128
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arg(parser)
    add_data_model_args(parser, batch_size=DEFAULT_BATCH_SIZE, seq_len=DEFAULT_SEQ_LEN)
    g = parser.add_argument_group("training")
    g.add_argument(
        "--epochs",
        metavar="N",
        type=positive_float,
        default=DEFAULT_EPOCHS,
        help=f"epochs of --epoch-tokens each, evaluated at each end (default: {DEFAULT_EPOCHS})",
    )
    g.add_argument(
        "--max-steps",
        metavar="N",
        type=positive_int,
        default=None,
        help="stop after N optimizer steps (overrides --epochs)",
    )
    g.add_argument(
        "--epoch-tokens",
        metavar="N",
        type=nonnegative_int,
        default=DEFAULT_EPOCH_TOKENS,
        help=f"training tokens per epoch (default: {DEFAULT_EPOCH_TOKENS:,}); 0: a full pass over the training split",
    )
    g.add_argument(
        "--lr",
        metavar="LR",
        type=positive_float,
        default=DEFAULT_LR,
        help=f"peak learning rate (default: {DEFAULT_LR:g})",
    )
    g.add_argument(
        "--optim",
        metavar="NAME",
        default="adamw_torch",
        help=f"optimizer, by HF's name: {', '.join(OPTIMIZER_NAMES)} (default: adamw_torch; the 8/4-bit ones "
        "need torchao: pip install 'mixprec[lean]')",
    )
    g.add_argument(
        "--output-dir",
        metavar="DIR",
        default=None,
        help=f"run folder (default: {_rundir.RUNS_DIR}/<date>-<time>); holds config, metrics, checkpoints and plots",
    )
    g.add_argument(
        "--resume",
        metavar="PATH",
        nargs="?",
        const=True,
        default=None,
        help="continue from the last checkpoint of --output-dir (or of the newest run in runs/), or of the run "
        "or checkpoint folder PATH; the run's saved flags are the defaults",
    )
    g.add_argument(
        "--comm-dtype",
        choices=COMM_NAMES,
        default=None,
        help="dtype gradients travel in between processes under torchrun: fp32 (default), bf16 (half the bytes), fp16",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model; under --precision auto (the "
        "default) only where the gain measured on its first steps wins back the compile time over the run",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass: less memory, about 20%% more time",
    )
    g.add_argument(
        "--step-in-backward",
        action="store_true",
        help="update each parameter during backward and free its gradient at once (less memory; turns off "
        "gradient clipping; not with fp16 or several processes)",
    )
    g.add_argument(
        "--diagnose", action="store_true", help="diagnose gradient ranges first and start the loss scale there"
    )
    g.add_argument(
        "--watch",
        metavar="N|fallback[:N]",
        type=watch_setting,
        default=None,
        help="watch every layer's range during the run: sample every N steps, warn before an overflow, trace "
        "skipped steps to a layer; 'fallback[:N]' also moves a layer that overflows to fp32 (default: off)",
    )
    g.add_argument(
        "--z-loss",
        metavar="W",
        type=z_loss_weight,
        default=0.0,
        help="add W * mean(logsumexp(logits)^2) to the built-in GPT's loss, against output-logit divergence at "
        "high learning rates (1e-4 is the usual weight; default: 0, off)",
    )
    add_lora_args(parser)


# -- the run ----------------------------------------------------------------------------------------------


def _training_arguments(args: argparse.Namespace, precision: Precision, output_dir: Path, eval_batch: int) -> Any:
    # deferred (start-up): the trainer's ~100 modules cost `mixprec train --help` 0.5-0.8 s; loaded to run
    from mixprec.trainer.args import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        precision=precision,  # parsed once, at the edge: the Trainer's Accelerator runs this very strategy
        num_train_epochs=float(args.epochs),
        max_steps=args.max_steps if args.max_steps is not None else -1,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=eval_batch,  # no autograd: a larger batch fits (_evaluation.py)
        learning_rate=args.lr,
        optim=args.optim,
        # nanoGPT's recipe for small models: AdamW(0.9, 0.99), decay 0.1 on matrices, clip 1, warmup + cosine
        adam_beta2=0.99,
        weight_decay=0.1,
        max_grad_norm=0.0 if args.step_in_backward else 1.0,  # clipping needs every gradient at once
        step_in_backward=args.step_in_backward,
        comm_dtype=args.comm_dtype,
        warmup_ratio=0.05,
        # nanoGPT's warm-up, whose first step trains: under HF's "cosine" (step 0 at lr 0) the default job
        # ended at 2.335 nats/byte (mean of 3 seeds; one stuck at 2.467), under this one at 2.256; at 150 steps,
        # 4 seeds, 2.736 against 2.593 (benchmarks/README.md, "vs_nanogpt")
        lr_scheduler_type="nanogpt_cosine",
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=2,
        async_save=True,  # a checkpoint stalls the step only for a walk of the state (benchmarks/README.md)
        logging_steps=10,
        logging_first_step=True,
        seed=args.seed,
        torch_compile=args.compile,
        gradient_checkpointing=args.gradient_checkpointing,
        diagnose_at_start=args.diagnose,
        precision_watch=args.watch,
        report_to="none",
    )


def _sample(model: torch.nn.Module, seed: int, device: torch.device, seq_len: int) -> str:
    """The prompt and a short sampled continuation (temperature 0.8, top 50), decoded as UTF-8 with invalid
    bytes replaced. Seeded, so the same run prints the same sample. At most ``seq_len`` bytes in all: the
    positions past the trained sequence length hold untrained embeddings (and HF's generate() does not crop
    to the model's block size)."""
    prompt = torch.tensor([encode(SAMPLE_PROMPT)], dtype=torch.long, device=device)
    new = max(0, min(SAMPLE_BYTES, seq_len - prompt.shape[1]))
    if isinstance(model, GPT):
        gen = torch.Generator(device=device).manual_seed(seed)
        out = model.generate(prompt, new, temperature=0.8, top_k=50, generator=gen)
    else:  # a Hugging Face model
        torch.manual_seed(seed)
        out = model.generate(prompt, max_new_tokens=new, do_sample=True, temperature=0.8, top_k=50, pad_token_id=0)
    # a vocabulary larger than the 256 bytes may still emit an id it never trained on: leave those out
    return decode([i for i in out[0].tolist() if 0 <= i < 256])


def _emit(text: str = "") -> None:
    """Print on the main process only, safely whatever the terminal's encoding."""
    if not _rundir.is_main():
        return
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(text.encode(enc, errors="replace").decode(enc), flush=True)


def run(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as hold:  # the run folder's lock, released when the run ends however it ends
        return _run(args, hold)


def _run(args: argparse.Namespace, hold: contextlib.ExitStack) -> int:
    wall_start = time.perf_counter()
    args._from_config_file = apply_config(args)
    _rundir.check_printable_paths(args)

    resume_from: Path | None = None
    deferred_check = False
    if args.resume is not None:  # lock, then choose the checkpoint (a crashed save recovered first)
        run_dir, named = _rundir.resume_run_dir(args.resume, args.output_dir)
        hold.enter_context(_rundir.lock_run_dir(run_dir))
        resume_from = _rundir.resume_checkpoint(run_dir, named)
        _rundir.apply_saved_flags(args, run_dir)
    else:
        env = LaunchEnv.from_environ()
        if args.output_dir is None and env.world_size > env.local_world_size:  # each node's clock names its own
            raise CliError("on several nodes, pass --output-dir: a folder every node sees (a shared filesystem)")
        run_dir = Path(args.output_dir) if args.output_dir is not None else _rundir.new_run_dir()
        # torchrun --max-restarts: the restarted workers rerun this command line into the run their
        # predecessors began; the Trainer resumes it from its newest complete checkpoint (if any). On several
        # nodes a node's workers can be restarted with their own count still 0: the processes decide together,
        # once they are connected (below)
        deferred_check = restarts_allowed_on_several_nodes()  # the same on every process: all join the vote
        if not restarted_by_launcher() and not deferred_check:
            _rundir.check_new_run_dir(run_dir)

    threads = None
    if _rundir.world_size() == 1 and not torch.cuda.is_available():  # a CPU run: threads for the load it meets
        threads = _threads.choose_threads()
        torch.set_num_threads(threads.threads)
    precision = parse_precision(args.precision, args.fp32_ops)  # the one parse of --precision / --fp32-ops
    check_optimizer_fits(precision, args.optim)  # bf16-pure steps with its own AdamW: said in flags, up front
    if args.step_in_backward:  # said in flags, before any process builds its model
        check_step_in_backward(precision, args.precision, _rundir.world_size())
    if args.gradient_checkpointing and precision.recompute_refusal:
        raise CliError(f"--gradient-checkpointing with --precision {precision.name}: {precision.recompute_refusal}")
    lora = lora_plan(args, precision)  # a bad --lora-* flag fails before anything is loaded
    if args.z_loss:  # so does --z-loss on a model without one (a Hugging Face model's weights load for minutes)
        if args.model not in GPT_PRESETS:
            raise CliError(f"--z-loss {args.z_loss:g}: only the built-in GPT has a z-loss; drop --z-loss for --model")
        if GPT_PRESETS[args.model].loss_chunk_size:
            raise CliError(f"--z-loss {args.z_loss:g}: the {args.model!r} preset's chunked loss has no z-loss term")
    model, train_chunks, val_chunks, info = load_model_and_data(args, lora.base_dtype if lora else None, precision)
    if args.z_loss:
        model.config.z_loss = args.z_loss  # read by each forward
    if lora is not None:
        model, lora_line = apply_lora(model, lora)
    chunks_per_epoch = len(train_chunks) if args.epoch_tokens == 0 else max(1, args.epoch_tokens // info.seq_len)
    train_dataset = EpochChunks(train_chunks, chunks_per_epoch, seed=args.seed)
    eval_dataset = eval_subset(val_chunks, info.seq_len)
    baseline = unigram_entropy(subset_tokens(eval_dataset))
    eval_batch = eval_batch_for(model, args.batch_size, info.seq_len, len(eval_dataset))
    training_args = _training_arguments(args, precision, run_dir, eval_batch)
    from mixprec.trainer.trainer import Trainer  # deferred (start-up), as TrainingArguments above

    epoch_what = "a full pass" if train_dataset.is_full_pass else f"{len(train_dataset) * info.seq_len:,} tokens"
    _emit(f"mixprec train: {info.model_description}")
    if lora is not None:
        _emit(f"  adapters    {lora_line}")
    _emit(f"  data        {info.corpus}; {info.train_tokens:,} training and {info.val_tokens:,} validation bytes")
    _emit(
        f"  epochs      {args.epochs:g} of {epoch_what} ({len(train_dataset):,} chunks of {info.seq_len}), "
        f"batch {args.batch_size}" + (f", at most {args.max_steps} steps" if args.max_steps else "")
    )
    _emit(
        f"  eval        {len(eval_dataset):,} validation chunks per epoch (batch {eval_batch}); unigram baseline "
        f"{baseline:.3f} nats/byte"
    )
    if threads is not None:
        _emit(f"  threads     {threads.describe()}")
    _emit(f"  run folder  {run_dir}" + (f" (resuming from {resume_from.name})" if resume_from else ""))

    hold.enter_context(_rundir.lock_run_dir(run_dir))  # before anything is written (re-entrant on a resume)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        callbacks=[EpochCallback(train_dataset), _rundir.SaveFlags(run_dir, _rundir.saved_flags(args))],
    )
    trainer.resume_command = f"mixprec train --resume {run_dir}"
    if args.resume is None and deferred_check and not restarted_anywhere(trainer.accelerator):
        _rundir.check_new_run_dir(run_dir)  # a first launch, on every node: a run folder already used is refused
    resume = str(resume_from) if resume_from else (True if args.resume is not None else None)
    try:
        output = trainer.train(resume_from_checkpoint=resume)
    except TrainingInterrupted as stop:
        # saved, and said how to resume; exit as the signal would have (143: SIGTERM), a stopped job to schedulers
        raise SystemExit(stop.exit_status) from None
    summary = dict(output.metrics)
    if resume_from is not None and not summary["train_loss_steps"]:  # past its end: the files keep the run
        trainer.accelerator.end_training()
        return 0

    history = trainer.state.log_history
    last_eval = _summary_table.last_value(history, "eval_loss")
    if last_eval is None or last_eval[1] != trainer.state.global_step:
        last_eval = (float(trainer.evaluate()["eval_loss"]), trainer.state.global_step)
    eval_loss = last_eval[0]

    if _rundir.is_main():
        _report(args, trainer, summary, eval_loss, baseline, info, run_dir, wall_start)
    # every process, once the main one has written the run: leave the process group together (wait for the
    # others, let the backend's threads finish, then destroy it), not at interpreter exit (see
    # mixprec.strategies.process_group: a gloo worker thread racing the shutdown aborted 3 runs in 30)
    trainer.accelerator.end_training()
    return 0


def _report(
    args: argparse.Namespace,
    trainer: Any,
    summary: dict[str, Any],
    eval_loss: float,
    baseline: float,
    info: DataModelInfo,
    run_dir: Path,
    wall_start: float,
) -> None:
    """The main process's end of a run: the sample, run.json and the summary table."""
    history = trainer.state.log_history
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    device = next(unwrapped.parameters()).device
    try:
        sample = _summary_table.printable(_sample(unwrapped, args.seed, device, info.seq_len))
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # the run itself succeeded and is saved
        sample = f"(no sample: generation failed: {exc})"
    rows = _summary_table.summary_rows(
        summary=summary,
        log_history=history,
        eval_loss=eval_loss,
        unigram_baseline=baseline,
        epochs_done=trainer.state.epoch,
        wall_seconds=time.perf_counter() - wall_start,
        num_processes=_rundir.world_size(),
        run_dir=str(run_dir),
        diagnosis=trainer.diagnosis,
    )
    record = {
        "flags": _rundir.saved_flags(args),
        "model": info.to_dict(),
        "training_arguments": trainer.args.to_dict(),
        "epoch_chunks": len(trainer.train_dataset),
        "eval_chunks": len(trainer.eval_dataset),
        "unigram_baseline": baseline,
        "eval_loss": eval_loss,
        "summary": summary,
        "sample": sample,
    }
    text = json.dumps(strict_json(record), indent=2, default=str, allow_nan=False)
    (run_dir / _rundir.RUN_FILE).write_text(text + "\n", encoding="utf-8")
    _emit()
    _emit(_summary_table.format_table(rows, "mixprec train: summary"))
    _emit()
    _emit(f"sample from the trained model (prompt {SAMPLE_PROMPT!r}, temperature 0.8):")
    _emit(sample)


COMMAND = Subcommand(
    name="train",
    description="Train a model with mixprec's Trainer and report what the precision did.",
    epilog=EPILOG,
    add_arguments=_add_arguments,
    run=run,
)
