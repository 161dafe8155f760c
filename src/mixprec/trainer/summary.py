"""End-of-run reporting: the run's summary, and what HF's example scripts write at their end.

The summary says what ran, how fast, and what the loss scaler did. The same numbers go three ways: the metrics
dict of ``TrainOutput`` (HF's ``train_runtime``, ``train_samples_per_second``, ... plus mixprec's),
``train_summary.json`` in output_dir, and a few printed lines on the main process.

HF's end-of-script methods keep HF's names and formats (:class:`ScriptEndings`, which the Trainer delegates
them to): ``log_metrics`` (a table on stdout), ``save_metrics`` (``<split>_results.json`` and ``all_results.json``)
and ``create_model_card`` (``README.md`` in output_dir). The figures drawn from metrics.jsonl are
:mod:`mixprec.trainer.plots`' (matplotlib, loaded only when a run plots).
"""

from __future__ import annotations

import datetime
import json
import platform
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec._version import __version__
from mixprec.trainer import plots
from mixprec.trainer.phase_clock import format_breakdown
from mixprec.trainer.state import STATE_FILE, TrainOutput
from mixprec.tree import strict_json

if TYPE_CHECKING:
    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.context import RunContext
    from mixprec.trainer.events import RunEvents
    from mixprec.trainer.state import TrainerState

SUMMARY_FILE = "train_summary.json"


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory and what it measures: the CUDA allocator's peak on a GPU, the process's peak resident set
    size on a CPU (which includes Python and torch themselves)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is kilobytes on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"


def build_summary(run: RunContext, steps_before: int) -> dict[str, Any]:
    """HF's train_* metrics, then mixprec's. Rates are over this process's work in this run (a resumed run
    counts from the resume); samples and tokens are summed over processes (one collective)."""
    acc, state, meter = run.accelerator, run.state, run.meter
    # on the device, which the collective's backend needs (nccl reduces CUDA tensors only)
    counts = torch.tensor([meter.samples, meter.tokens], dtype=torch.float64, device=acc.device)
    samples, tokens = (int(n) for n in acc.reduce(counts).tolist())
    precision, decision = acc.precision.describe(), acc.auto_decision
    steps_this_run = state.global_step - steps_before
    runtime = max(meter.elapsed(), 1e-9)
    train_loss = meter.mean_loss()  # reads the open window: the filter's count below includes it
    peak, peak_kind = peak_memory_bytes(acc.device)
    summary: dict[str, Any] = {
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(samples / runtime, 3),
        "train_steps_per_second": round(steps_this_run / runtime, 3),
        "train_loss": train_loss,
        "train_loss_steps": steps_this_run,  # train_loss is the mean over these steps (this run's)
        "train_loss_left_out": meter.filtered,  # ... but for these non-finite micro-batch losses (HF's filter)
        "epoch": state.epoch,
        "global_step": state.global_step,
        "skipped_steps": acc.scaler.record.skipped_steps,
        "final_loss_scale": acc.scaler.get_scale() if acc.scaler.is_enabled() else None,
        "precision": precision.get("precision"),
        "precision_reason": precision.get("reason"),
        "precision_loss_scaling": precision.get("loss_scaling"),
        # how gradients travel between processes ("" for one process in fp32)
        "comm": acc.config.comm_dtype.describe(acc.num_processes),
        "auto_precision": decision.to_dict() if decision is not None else None,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
    }
    if tokens:
        summary["train_tokens_per_second"] = round(tokens / runtime, 1)
    if state.best_metric is not None:
        summary["best_metric"] = state.best_metric
        summary["best_metric_name"] = run.args.evaluation.metric_key()
        summary["best_model_checkpoint"] = state.best_model_checkpoint
    # this run's race: the op timing, the trials and their replay, or a re-check
    race = decision.seconds_this_run if decision is not None else 0.0
    summary["time"] = meter.phases.breakdown(summary["train_runtime"], steps_this_run, race)
    return summary


def mean_over(summary: dict[str, Any]) -> str:
    """What ``train_loss`` is the mean of: this run's steps, less the non-finite losses the filter left out."""
    said = f"the mean over the {summary.get('train_loss_steps', '')} steps this run took"
    left_out = summary.get("train_loss_left_out")
    return f"{said}, {left_out} non-finite losses left out" if left_out else said


def format_summary(summary: dict[str, Any]) -> str:
    """A few readable lines for the end of a run."""
    # this run's steps, as the rates and the loss below count them (a resumed run: the run's total beside)
    steps, total = summary.get("train_loss_steps", summary["global_step"]), summary["global_step"]
    lines = [
        # the precision's reason was said when it was decided (or asked for): here the name alone (issue 29:
        # the same sentence three times per run)
        f"trained {steps} steps{f' ({total} in all)' if total != steps else ''} in {summary['train_runtime']:.1f}s"
        f" ({summary['precision']}" + (f"; {summary['comm']}" if summary.get("comm") else "") + ")",
        f"  train loss {summary['train_loss']:.4f} ({mean_over(summary)}); skipped steps {summary['skipped_steps']}"
        + (f"; final loss scale {summary['final_loss_scale']:g}" if summary.get("final_loss_scale") else ""),
        f"  throughput {summary['train_samples_per_second']:.1f} samples/s"
        + (f", {summary['train_tokens_per_second']:.0f} tokens/s" if "train_tokens_per_second" in summary else ""),
        f"  peak memory {summary['peak_memory_bytes'] / 2**20:.0f} MiB ({summary['peak_memory_kind']})",
    ]
    if "time" in summary:
        lines.append(format_breakdown(summary["time"]))
    if summary.get("compile"):
        lines.append(f"  {summary['compile']['explain']}")
    if "best_metric" in summary:
        lines.append(
            f"  best {summary['best_metric_name']} {summary['best_metric']:.4g} at {summary['best_model_checkpoint']}"
        )
    return "\n".join(lines)


def write_summary(summary: dict[str, Any], output_dir: str | Path) -> Path:
    path = Path(output_dir) / SUMMARY_FILE
    path.write_text(json.dumps(strict_json(summary), indent=2, default=str, allow_nan=False) + "\n", encoding="utf-8")
    return path


def finish_run(run: RunContext, steps_before: int, compiled: dict[str, Any] | None = None) -> TrainOutput:
    """Close the bar, summarise (:func:`build_summary`), write the summary and the plots (main process), fire
    ``on_train_end`` (whose callbacks may add a section to the summary, as the precision watch's does: then the
    file is written again, with it). ``compiled``: what compiling measured and did (compile_gate.py), when the
    run compiles."""
    acc, args, state, events = run.accelerator, run.args, run.state, run.events
    events.close_progress()  # before the summary and plots, which take a moment
    summary = build_summary(run, steps_before)
    if compiled is not None:
        summary["compile"] = compiled
    memory: dict[str, int] = {}
    if run.memory is not None:  # HF's <stage>_mem_* metrics: in the returned metrics and the last log entry
        run.memory.stop("train", memory)
        summary.update(memory)
    # HF's last log entry, which scripts read from log_history[-1]
    last = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
    run.log({**{k: summary[k] for k in last}, **memory})
    trained = summary["train_loss_steps"] > 0 or not steps_before  # a resume past the end trains nothing
    if acc.is_main_process and trained:
        write_summary(summary, args.output_dir)
        if args.save_plots and events.metrics_path is not None:
            plots.plot_run(events.metrics_path, args.output_dir)  # through the module, where a test replaces it
        print(format_summary(summary), file=sys.stderr, flush=True)
    elif acc.is_main_process:  # the files keep the run that trained
        said = f"nothing to train: resumed at step {state.global_step}, at or past this run's end (max_steps "
        said += f"{state.max_steps}); its summary and plots stay the last training's"
        print(said, file=sys.stderr)
    sections = set(summary)
    events.fire("on_train_end", summary=summary)
    if acc.is_main_process and trained and set(summary) != sections:  # a callback added its section: write again
        write_summary(summary, args.output_dir)
    return TrainOutput(state.global_step, summary["train_loss"], summary)


# -- HF's end-of-script reporting: log_metrics, save_metrics, create_model_card ----------------------------

ALL_RESULTS = "all_results.json"


def _duration(seconds: float) -> str:
    whole = datetime.timedelta(seconds=int(seconds))
    return f"{whole}.{int(round((seconds % 1) * 100)) % 100:02d}"


def model_card(
    *,
    model_name: str,
    precision: str,
    hyperparameters: dict[str, Any],
    log_history: list[dict[str, Any]],
    language: Any = None,
    license: str | None = None,
    tags: Any = None,
    finetuned_from: str | None = None,
    tasks: Any = None,
    dataset: Any = None,
) -> str:
    """A model card in HF's shape: YAML front matter, what was trained and how, the evaluation results and
    the framework versions. Only what the run knows; nothing is made up."""
    front = {"library_name": "transformers", "tags": ["mixprec", *_list(tags)]}
    for key, value in (("license", license), ("language", language), ("base_model", finetuned_from)):
        if value:
            front[key] = value
    lines = ["---", *(f"{k}: {json.dumps(v)}" for k, v in front.items()), "---", "", f"# {model_name}", ""]
    trained = f"This model was trained with mixprec in {precision}"
    trained += f", from {finetuned_from}" if finetuned_from else ""
    trained += f", on {', '.join(map(str, _list(dataset)))}" if dataset else ""
    lines += [trained + ".", ""]
    if tasks:
        lines += [f"Task: {', '.join(map(str, _list(tasks)))}.", ""]
    lines += ["## Training hyperparameters", ""]
    lines += [f"- {k}: {v}" for k, v in hyperparameters.items() if v is not None]
    evals = [e for e in log_history if any(k.startswith("eval_") for k in e)]
    if evals:
        keys = [k for k in evals[-1] if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))]
        lines += ["", "## Evaluation results", "", "| step | epoch | " + " | ".join(keys) + " |"]
        lines += ["|" + " --- |" * (len(keys) + 2)]
        for e in evals:
            row = [str(e.get("step", "")), _cell(e.get("epoch"))] + [_cell(e.get(k)) for k in keys]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Framework versions", "", f"- mixprec {__version__}", f"- torch {torch.__version__}"]
    lines += [f"- Python {platform.python_version()}", ""]
    return "\n".join(lines)


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


class ScriptEndings:
    """HF's end-of-script methods of the Trainer (``log_metrics``, ``save_metrics``, ``save_state``,
    ``create_model_card``...): a part :class:`~mixprec.trainer.trainer.Trainer` owns and delegates them to.
    It reads the run's arguments, its state (through ``events``, which owns it: a state the Trainer replaces
    is the one read) and its Accelerator, and writes on the main process only."""

    def __init__(self, args: TrainingArguments, events: RunEvents, accelerator: Accelerator) -> None:
        self.args = args
        self._events = events
        self.accelerator = accelerator

    @property
    def state(self) -> TrainerState:
        return self._events.state

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process, the one that saves and logs."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the first process on its machine."""
        return self.accelerator.is_local_main_process

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """HF's readable forms of ``metrics``: ``*_runtime`` as h:mm:ss.ss, ``*_mem_*`` in MB, ``total_flos`` in
        GF, other floats to 4 decimals."""
        shown: dict[str, Any] = {}
        for key, value in metrics.items():
            if "_mem_" in key and isinstance(value, (int, float)):
                shown[key] = f"{int(value) >> 20}MB"
            elif key.endswith("_runtime") and isinstance(value, (int, float)):
                shown[key] = _duration(float(value))
            elif key == "total_flos" and isinstance(value, (int, float)):
                shown[key] = f"{int(value) >> 30}GF"
            elif isinstance(value, float):
                shown[key] = round(value, 4)
            else:
                shown[key] = value
        return shown

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` as HF's ``***** <split> metrics *****`` table, one aligned ``key = value`` line per
        metric (main process)."""
        if not self.is_world_process_zero():
            return
        shown = self.metrics_format(metrics)
        # mixprec's sections (a dict, the precision's reason) are not HF's scalars: they are said in the run's
        # summary and train_summary.json, and padding every figure to their width made a 300-column table
        shown = {k: ("(train_summary.json)" if isinstance(v, (dict, list)) else v) for k, v in shown.items()}
        keys = max((len(str(k)) for k in shown), default=0)
        values = max((len(str(v)) for v in shown.values() if len(str(v)) <= 24), default=0)
        lines = [f"  {k: <{keys}} = {str(shown[k]):>{values}}" for k in sorted(shown)]
        print("\n".join([f"***** {split} metrics *****", *lines]), flush=True)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``<split>_results.json`` (and merge into ``all_results.json`` when ``combined``) in output_dir
        (main process)."""
        if not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        plain = strict_json(dict(metrics))
        (out / f"{split}_results.json").write_text(json.dumps(plain, indent=4, sort_keys=True) + "\n", encoding="utf-8")
        if combined:
            every = out / ALL_RESULTS
            merged = json.loads(every.read_text(encoding="utf-8")) if every.exists() else {}
            merged.update(plain)
            every.write_text(json.dumps(merged, indent=4, sort_keys=True) + "\n", encoding="utf-8")

    def save_state(self) -> None:
        """Write the trainer state as output_dir/trainer_state.json (main process), as HF."""
        if self.is_world_process_zero():
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(Path(self.args.output_dir) / STATE_FILE)

    def create_model_card(
        self,
        language: Any = None,
        license: str | None = None,
        tags: Any = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: Any = None,
        dataset_tags: Any = None,
        dataset: Any = None,
        dataset_args: Any = None,
    ) -> None:
        """Write output_dir/README.md: what was trained, in which precision, with which hyperparameters, and
        the evaluation results of this run (main process; HF's arguments)."""
        if not self.is_world_process_zero():
            return
        args = self.args
        hyperparameters = {
            "learning_rate": args.learning_rate,
            "train_batch_size": args.per_device_train_batch_size,
            "eval_batch_size": args.per_device_eval_batch_size,
            "seed": args.seed,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "total_train_batch_size": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * self.accelerator.num_processes,
            "optimizer": args.optim,
            "lr_scheduler_type": args.lr_scheduler_type,
        }
        if args.max_steps > 0:
            hyperparameters["training_steps"] = args.max_steps
        else:
            hyperparameters["num_epochs"] = args.num_train_epochs
        text = model_card(
            model_name=model_name or Path(args.output_dir).name,
            precision=self.accelerator.mixed_precision,
            hyperparameters=hyperparameters,
            log_history=self.state.log_history,
            language=language,
            license=license,
            tags=tags,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset=dataset if dataset is not None else dataset_tags,
        )
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "README.md").write_text(text, encoding="utf-8")
