"""The levels a combination cell runs at: a plain GradScaler loop, the Accelerator, the Trainer (the command
line is driven from the test module). Each runs a few steps of a tiny model and records what the invariants
need into a :class:`~combo_checks.Findings`. Not collected by pytest."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from combo_checks import (
    FigureMismatch,
    Findings,
    Plant,
    ResumeDiffers,
    SkipLeaked,
    clone_tree,
    differing,
    same_tree,
)

import mixprec
from conftest import make_batches, make_tiny_lm
from mixprec import GPT, Accelerator
from mixprec.precision import auto
from mixprec.precision.registry import resolve_precision

RACES = {"auto-inrun": "in-run", "auto-aside": "aside"}


def precision_name(precision: str) -> str:
    """The name the library is given: both auto cells are "auto", raced as MIXPREC_AUTO_RACE says."""
    return "auto" if precision in RACES else precision


def set_race(precision: str, monkeypatch) -> None:
    """How the cell's auto races. An in-run race is timed on a planted clock on which every step takes 1 ms.
    The cells' runs are shorter than the race (``EARLY_ROUNDS`` rounds of every mode), so it is still racing
    at checkpoint-2, and the resumed run races again from there (checkpoints.md: such a resume is exact only
    where its steps run in the same modes). On the thread's CPU time a step over the race's time limit (a busy
    neighbour) is timed again in its mode, the two runs' steps then differ in mode, and the cell failed by
    chance; on the planted clock both runs time the modes in the same order."""
    if precision in RACES:
        monkeypatch.setenv("MIXPREC_AUTO_RACE", RACES[precision])
    else:
        monkeypatch.delenv("MIXPREC_AUTO_RACE", raising=False)
    if precision == "auto-inrun":
        ticks = itertools.count()
        monkeypatch.setattr(auto, "race_clock", lambda device: (lambda: next(ticks) * 1e-3, "planted clock"))


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class SkipCheck:
    """Around the step a :class:`Plant` poisons: the weights and the optimizer's state (moments, step counts)
    before its optimizer step, compared after it."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.weights = model_state(model)
        self.state = clone_tree(optimizer.state_dict()["state"])

    def after(self, findings: Findings, where: str) -> None:
        moved = differing(self.weights, model_state(self.model))
        findings.expect(not moved, SkipLeaked, f"{where}: the skipped step changed weights {moved[:4]}")
        findings.expect(
            same_tree(self.state, optimizer_state(self.optimizer)),
            SkipLeaked,
            f"{where}: the skipped step changed the optimizer's moments or step counts",
        )


def optimizer_state(optimizer: Any) -> Any:
    return clone_tree(optimizer.state_dict()["state"])


# -- a plain loop: the precision's autocast and its scaler --------------------------------------------------


def scaler_loop(precision: str, findings: Findings, steps: int = 5, skip_at: int = 3) -> None:
    """The seed's first loop with a precision object: ``mixprec.autocast(p)``, ``p.scaler`` (a GradScaler for
    fp16, the non-finite guard otherwise), ``p.convert_module``/``convert_optimizer`` (pure bf16's own)."""
    with mixprec.autocast(precision_name(precision)):  # "auto" is refused here, at the edge
        pass
    p = resolve_precision(precision, "cpu")
    model = p.convert_module(make_tiny_lm())
    optimizer = p.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = p.scaler
    plant = Plant(model.head.weight)
    for step, batch in enumerate(make_batches(steps), 1):
        plant.armed = step == skip_at
        with mixprec.autocast(p):
            loss = model(batch["input_ids"], labels=batch["labels"]).loss
        scaler.scale(loss).backward()
        check = SkipCheck(model, optimizer) if step == skip_at else None
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if check is not None:
            check.after(findings, f"{precision} GradScaler loop, step {step}")
            backed_off = scale / 2 if p.needs_loss_scaling else scale
            findings.expect(scaler.get_scale() == backed_off, SkipLeaked, f"scale {scale} -> {scaler.get_scale()}")
    record = scaler.record
    findings.expect(
        (record.steps, record.skipped_steps) == (steps, 1),
        SkipLeaked,
        f"the scaler counted {record.steps} steps, {record.skipped_steps} skipped; expected {steps}, 1",
    )
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


# -- the Accelerator ---------------------------------------------------------------------------------------


def _lambda(step: int) -> float:
    return 1.0 / (1 + step)


def accelerator_skip_capsule(precision: str, run: Path, findings: Findings, said) -> list[str]:
    """The built-in tiny GPT under ``Accelerator(watch=...)``: step 3's gradient is planted non-finite; the
    step must be skipped (weights, moments, scheduler, counters) and its capsule written into the run folder.
    Returns the capsules' folders."""
    torch.manual_seed(0)
    acc = Accelerator(
        mixed_precision=precision_name(precision), cpu=True, watch={"every": 2}, project_dir=run, verbose=False
    )
    model = GPT.from_preset("tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, scheduler = acc.prepare(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _lambda))
    plant = Plant(model.get_submodule("transformer.h.1.mlp.c_fc").weight)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        ids = torch.randint(0, 256, (4, 16), generator=g)
        plant.armed = step == 3
        acc.backward(model(input_ids=ids, labels=ids).loss)
        check = SkipCheck(model, optimizer) if step == 3 else None
        lr = scheduler.get_last_lr()
        optimizer.step()
        scheduler.step()
        acc.watch.sync(optimizer)
        optimizer.zero_grad()
        if check is not None:
            where = f"{precision} Accelerator, step {step}"
            check.after(findings, where)
            findings.expect(acc.optimizer_step_was_skipped, SkipLeaked, f"{where}: not reported as skipped")
            findings.expect(scheduler.get_last_lr() == lr, SkipLeaked, f"{where}: the schedule advanced")
    acc.watch.close()
    said.add_text(f"watch summary: {acc.watch.summary()}")  # what the run record shows
    return [c["path"] for c in acc.watch.capsules]


def accelerator_resume(precision: str, run: Path, findings: Findings) -> None:
    """A loop that saves its state once auto has decided (at once for a named mode), then goes on 3 steps;
    a second Accelerator loads that state and takes the same 3 steps: the weights must be bit-identical."""
    batches = make_batches(80)

    def start() -> tuple[Accelerator, Any, Any, Any]:
        acc = Accelerator(mixed_precision=precision_name(precision), cpu=True, project_dir=run, verbose=False)
        model = make_tiny_lm()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, _lambda)
        return acc, *acc.prepare(model, optimizer, sched)

    def step(acc, model, optimizer, scheduler, batch) -> None:
        acc.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    acc, model, optimizer, scheduler = start()
    saved_at = None
    for i, batch in enumerate(batches):
        step(acc, model, optimizer, scheduler, batch)
        if saved_at is None and not acc.precision_racing and i >= 1:
            acc.save_state(run / "state")
            saved_at = i
        elif saved_at is not None and i == saved_at + 3:
            break
    assert saved_at is not None and i == saved_at + 3, "the race never decided in 80 steps"
    uninterrupted = model_state(model)
    acc2, model2, optimizer2, scheduler2 = start()
    acc2.load_state(run / "state")
    for batch in batches[saved_at + 1 : saved_at + 4]:
        step(acc2, model2, optimizer2, scheduler2, batch)
    moved = differing(uninterrupted, model_state(model2))
    findings.expect(not moved, ResumeDiffers, f"{precision} Accelerator resumed: {moved[:4]} differ")
    findings.expect(
        acc2.mixed_precision == acc.mixed_precision,
        ResumeDiffers,
        f"resumed as {acc2.mixed_precision}, ran as {acc.mixed_precision}",
    )


def accelerator_lora(precision: str, hf_folder: str, findings: Findings) -> None:
    """peft's LoRA adapters on a frozen fp32 GPT-2 base, through the Accelerator: the adapters learn and the
    base stays as loaded."""
    import peft
    import transformers

    acc = Accelerator(mixed_precision=precision_name(precision), cpu=True, verbose=False)
    base = transformers.GPT2LMHeadModel.from_pretrained(hf_folder)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
    frozen = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 256, (4, 16), generator=g)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    # held in the precision's parameter dtype (pure bf16: rounded to bf16 once), never updated
    changed = [k for k, v in frozen.items() if not torch.equal(v.to(after[k].dtype), after[k].detach())]
    assert not changed, f"the frozen base changed: {changed[:3]}"
    assert any(v.abs().sum() > 0 for k, v in after.items() if "lora_B" in k), "the adapters learned nothing"


# -- the Trainer -------------------------------------------------------------------------------------------


def trainer_args(run: Path, precision: str, **kwargs: Any) -> mixprec.TrainingArguments:
    defaults = dict(
        output_dir=str(run),
        precision=precision_name(precision),
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-2,
        report_to="none",
    )
    return mixprec.TrainingArguments(**{**defaults, **kwargs})


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def check_train_figures(output: Any, run: Path, findings: Findings, since_step: int = 0) -> None:
    """The loss ``train()`` reports is the mean of the per-step losses the metrics file logged in this run
    (steps after ``since_step``), and the same figure the file's summary entry holds."""
    events = metrics(run)
    losses = [e["loss"] for e in events if "loss" in e and "event" not in e and e["step"] > since_step]
    summary = [e for e in events if "train_loss" in e][-1]
    findings.expect(
        summary["train_loss"] == output.training_loss,
        FigureMismatch,
        f"train() returned loss {output.training_loss}, metrics.jsonl {summary['train_loss']}",
    )
    mean = sum(losses) / max(1, len(losses))
    findings.expect(
        abs(output.training_loss - mean) <= 1e-6 * max(1.0, abs(mean)),
        FigureMismatch,
        f"train loss {output.training_loss:.6f} is not the mean {mean:.6f} of the {len(losses)} steps logged",
    )


def gpt_examples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, 16), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def trainer_resume(precision: str, run: Path, findings: Findings) -> None:
    """A 4-step Trainer run saving every 2 steps; a copy of its folder as the crash after checkpoint-2 left it,
    resumed: the same final weights, and a summary loss that is the mean over this run's own 2 steps."""
    from trainer_utils import make_examples, make_model

    def trainer(folder: Path) -> mixprec.Trainer:
        args = trainer_args(folder, precision, max_steps=4, save_strategy="steps", save_steps=2)
        return mixprec.Trainer(make_model(dropout=0.1), args, train_dataset=make_examples(64))

    first = trainer(run)
    first.train()
    again = run.parent / f"{run.name}-resumed"
    again.mkdir()
    shutil.copytree(run / "checkpoint-2", again / "checkpoint-2")
    (again / "metrics.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in metrics(run) if e.get("step", 0) <= 2 and "train_loss" not in e)
    )
    second = trainer(again)
    output = second.train(resume_from_checkpoint=str(again / "checkpoint-2"))
    moved = differing(model_state(first.model), model_state(second.model))
    findings.expect(not moved, ResumeDiffers, f"{precision} Trainer resumed from checkpoint-2: {moved[:4]} differ")
    check_train_figures(output, again, findings, since_step=2)


def trainer_watch(precision: str, run: Path, findings: Findings) -> None:
    """The precision watch sampling every step of a Trainer run whose step 2 is planted non-finite: the step
    is skipped and counted once, and the summary's figures match the metrics file."""
    from trainer_utils import make_examples, make_model

    model = make_model(dropout=0.0)
    plant = Plant(model.head.weight)

    class Arm(mixprec.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            plant.armed = state.global_step + 1 == 2

    args = trainer_args(run, precision, max_steps=4, precision_watch=1)
    trainer = mixprec.Trainer(model, args, train_dataset=make_examples(64), callbacks=[Arm()])
    output = trainer.train()
    skips = [e["step"] for e in metrics(run) if e.get("event") == "skipped_step"]
    findings.expect(skips == [2], SkipLeaked, f"{precision} Trainer: skipped_step events at {skips}, planted at 2")
    findings.expect(trainer.skipped_steps == 1, SkipLeaked, f"{trainer.skipped_steps} skipped steps counted")
    check_train_figures(output, run, findings)


def trainer_z_loss(precision: str, run: Path, findings: Findings) -> None:
    """The built-in GPT with a z-loss under the Trainer: finite, and the reported loss is the logged mean."""
    torch.manual_seed(0)
    model = GPT(mixprec.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, z_loss=1e-2))
    args = trainer_args(run, precision, max_steps=3, per_device_train_batch_size=4)
    output = mixprec.Trainer(model, args, train_dataset=gpt_examples(16)).train()
    check_train_figures(output, run, findings)


def trainer_hf_parser(precision: str, run: Path, findings: Findings) -> None:
    """HF's own parser builds the arguments from argv, as run_clm.py does; the Trainer runs in that mode."""
    import transformers

    from trainer_utils import make_examples, make_model

    argv = [
        "--output_dir",
        str(run),
        "--precision",
        precision_name(precision),
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--report_to",
        "none",
    ]
    (args,) = transformers.HfArgumentParser(mixprec.TrainingArguments).parse_args_into_dataclasses(argv)
    assert args.precision == precision_name(precision)
    trainer = mixprec.Trainer(make_model(dropout=0.0), args, train_dataset=make_examples(32))
    output = trainer.train()
    if precision not in RACES:
        assert trainer.accelerator.mixed_precision == precision
    check_train_figures(output, run, findings)


def env_without_ranks() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
