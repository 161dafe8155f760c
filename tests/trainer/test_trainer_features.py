"""Trainer features HF scripts rely on (issue 12): early stopping, model_init, train() twice, one model through
two Trainers, save_strategy="best", activation checkpointing, streams, MLflow/W&B reporting, config.json in
checkpoint folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from mixprec import GPT, EarlyStoppingCallback, Trainer, TrainerControl, TrainingArguments
from mixprec.checkpoint import load_tensors
from mixprec.checkpoint.folders import trainer_folders
from mixprec.loaders.from_datasets import ShardedStream
from trainer_utils import SEQ, VOCAB, flat_params, make_examples, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


def quiet_args(tmp_path, **kwargs) -> TrainingArguments:
    defaults = {"output_dir": str(tmp_path / "out"), "disable_tqdm": True, "save_plots": False, "save_strategy": "no"}
    return TrainingArguments(**{**defaults, **kwargs})


class ScriptedEval(Trainer):
    """Evaluation losses follow a script (one eval batch per evaluation), training is real."""

    def __init__(self, *args, eval_losses, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_losses = list(eval_losses)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        if not model.training:
            loss = torch.tensor(self.eval_losses.pop(0))
        return (loss, outputs) if return_outputs else loss


def scripted(tmp_path, losses, callbacks=(), **kwargs):
    args = quiet_args(
        tmp_path, max_steps=20, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8, **kwargs
    )
    return ScriptedEval(
        make_model(dropout=0.0),
        args,
        train_dataset=make_examples(32),
        eval_dataset=make_examples(8, 1),
        callbacks=list(callbacks),
        eval_losses=losses,
    )


# -- early stopping and the best model -------------------------------------------------------------------


def test_early_stopping_stops_after_patience_and_loads_the_best_model(tmp_path):
    trainer = scripted(
        tmp_path,
        [1.0, 0.9, 0.95, 0.92, 0.5],
        [EarlyStoppingCallback(early_stopping_patience=2)],
        load_best_model_at_end=True,
        save_strategy="steps",
        save_steps=1,
    )
    trainer.train()
    assert trainer.state.global_step == 4  # 0.95 and 0.92 do not beat 0.9: two strikes
    assert trainer.state.best_metric == pytest.approx(0.9)
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-2"
    best = load_tensors(Path(trainer.state.best_model_checkpoint) / "model.safetensors")
    now = flat_params(trainer.model)
    assert all(torch.equal(best[k], now[k]) for k in best)


def test_early_stopping_threshold_counts_small_gains_as_none():
    cb = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=0.1)
    args = TrainingArguments(metric_for_best_model="loss", eval_strategy="epoch")

    class State:
        best_metric = 1.0

    control = TrainerControl()
    cb.on_evaluate(args, State(), control, metrics={"eval_loss": 0.95})  # better, but by less than 0.1
    assert control.should_training_stop


def test_early_stopping_without_a_metric_is_refused(tmp_path):
    trainer = Trainer(
        make_model(),
        quiet_args(tmp_path, max_steps=2),
        train_dataset=make_examples(8),
        callbacks=[EarlyStoppingCallback()],
    )
    with pytest.raises(ValueError, match="metric_for_best_model"):
        trainer.train()


def test_save_strategy_best_saves_only_new_bests(tmp_path):
    trainer = scripted(tmp_path, [1.0, 1.2, 0.8, 0.9], save_strategy="best", metric_for_best_model="loss")
    trainer.args.max_steps = 4
    trainer.train()
    assert [p.name for p in trainer_folders(trainer.args.output_dir).complete()] == ["checkpoint-1", "checkpoint-3"]


# -- model_init, train() twice, one model in two Trainers -----------------------------------------------------


def test_model_init_builds_a_fresh_model_per_train_and_is_reproducible(tmp_path):
    built = []

    def model_init():
        built.append(make_model(seed=3))
        return built[-1]

    trainer = Trainer(model_init=model_init, args=quiet_args(tmp_path, max_steps=3), train_dataset=make_examples(24))
    first = trainer.train()
    params_first = flat_params(trainer.model)
    second = trainer.train()
    assert len(built) == 3  # one at construction, one per train(), as HF
    assert trainer.model is built[-1]
    assert first.training_loss == second.training_loss
    assert all(torch.equal(v, flat_params(trainer.model)[k]) for k, v in params_first.items())
    with pytest.raises(ValueError, match="model_init"):
        Trainer(model_init=model_init, args=quiet_args(tmp_path), optimizers=(object(), None))


def test_a_seed_set_after_construction_is_the_one_train_uses(tmp_path):
    # HF's test_model_init: ``trainer.args.seed = 314`` before train() gives the run a Trainer built with 314 gives
    def model_init():
        return make_model(dropout=0.0)

    def run(build_seed, train_seed):
        args = quiet_args(tmp_path, max_steps=6, seed=build_seed, per_device_train_batch_size=4)
        trainer = Trainer(model_init=model_init, args=args, train_dataset=make_examples(24))
        trainer.args.seed = train_seed
        trainer.train()
        return flat_params(trainer.model)

    with_314 = run(314, 314)
    changed_later = run(42, 314)
    with_42 = run(42, 42)
    assert all(torch.equal(v, changed_later[k]) for k, v in with_314.items())
    assert any(not torch.equal(v, with_42[k]) for k, v in with_314.items())  # the data order did change


def test_trainable_parameter_count_and_model_wrapped(tmp_path):
    model = make_model()
    trainer = Trainer(model, quiet_args(tmp_path, max_steps=1), train_dataset=make_examples(8))
    total = sum(p.numel() for p in model.parameters())
    assert trainer.get_num_trainable_parameters() == total
    model.head.weight.requires_grad_(False)
    assert trainer.get_num_trainable_parameters() == total - model.head.weight.numel()
    trainer.train()
    wrapped = trainer.model_wrapped
    trainer.train()
    assert trainer.model_wrapped is wrapped  # prepared once, however many train() calls


def test_train_twice_continues_the_model_with_a_fresh_state_and_resumes(tmp_path):
    args = quiet_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4, logging_steps=1)
    trainer = Trainer(make_model(), args, train_dataset=make_examples(32))
    trainer.train()
    after_first = flat_params(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 4  # a fresh state, as HF
    assert any(not torch.equal(v, flat_params(trainer.model)[k]) for k, v in after_first.items())
    # the second run's checkpoint holds one model/optimizer/scheduler: a new Trainer resumes from it
    fresh = Trainer(
        make_model(),
        quiet_args(tmp_path, max_steps=5, save_strategy="steps", save_steps=4),
        train_dataset=make_examples(32),
    )
    fresh.train(resume_from_checkpoint=True)
    assert fresh.state.global_step == 5


def test_a_model_trained_by_one_trainer_is_trained_and_evaluated_by_another(tmp_path):
    model = make_model()
    data = make_examples(16)
    Trainer(model, quiet_args(tmp_path / "a", max_steps=2), train_dataset=data).train()
    second = Trainer(model, quiet_args(tmp_path / "b", max_steps=2, bf16=True), train_dataset=data, eval_dataset=data)
    seen = set()
    model.head.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    before = flat_params(model)
    second.train()
    assert "eval_loss" in second.evaluate()
    assert torch.bfloat16 in seen  # the second Trainer's precision runs the model now
    assert any(not torch.equal(v, flat_params(model)[k]) for k, v in before.items())


# -- activation checkpointing ----------------------------------------------------------------------------


def test_gpt_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 32))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(1)
        model = GPT.from_preset("tiny")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


def test_training_argument_turns_checkpointing_on_or_names_the_field(tmp_path):
    gpt = GPT.from_preset("tiny")
    rows = [{"input_ids": torch.randint(0, 256, (16,))} for _ in range(8)]
    rows = [{**r, "labels": r["input_ids"]} for r in rows]
    Trainer(gpt, quiet_args(tmp_path, max_steps=1, gradient_checkpointing=True), train_dataset=rows).train()
    assert gpt.is_gradient_checkpointing
    trainer = Trainer(
        make_model(), quiet_args(tmp_path, max_steps=1, activation_checkpointing=True), train_dataset=make_examples(8)
    )
    with pytest.raises(ValueError, match=r"activation_checkpointing=True\): DropLM has no"):
        trainer.train()


# -- streams ------------------------------------------------------------------------------------------------


class Numbers(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n, self.passes = n, 0

    def __iter__(self):
        self.passes += 1
        for i in range(self.n):
            yield {"input_ids": torch.full((SEQ,), i % VOCAB), "labels": torch.full((SEQ,), (i + 1) % VOCAB)}


def test_a_stream_is_split_into_whole_batches_with_no_example_twice():
    shards = [list(ShardedStream(range(23), batch_size=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert shards == [[0, 1, 2, 6, 7, 8, 12, 13, 14], [3, 4, 5, 9, 10, 11, 15, 16, 17]]  # 18-22: a short group
    resumed = ShardedStream(range(23), batch_size=3, num_replicas=2, rank=1)
    resumed.skip_batches(2)
    assert list(resumed) == [15, 16, 17]  # the rank's third batch, as the uninterrupted run reads it


def test_trainer_trains_a_stream_for_max_steps_rereading_it(tmp_path):
    stream = Numbers(20)
    trainer = Trainer(
        make_model(),
        quiet_args(tmp_path, max_steps=7, per_device_train_batch_size=4),
        train_dataset=stream,
        eval_dataset=Numbers(8),
    )
    trainer.train()
    assert trainer.state.global_step == 7 and stream.passes == 2  # 5 batches a pass
    assert "eval_loss" in trainer.evaluate()


def test_an_empty_stream_is_refused_at_its_first_pass(tmp_path):
    # it spun through empty passes for ever (a stream's epochs have no end), deaf to SIGTERM (no step boundary)
    trainer = Trainer(make_model(), quiet_args(tmp_path, max_steps=3), train_dataset=Numbers(0))
    with pytest.raises(ValueError, match=r"train_dataset gave no batch in a whole pass \(epoch 0\)"):
        trainer.train()


def _first_column(batches) -> list[list[int]]:
    return [[int(row[0]) for row in batch["input_ids"]] for batch in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streams_resume_skip_is_its_pass_alone_and_its_short_last_batch_stays(workers):
    # with DataLoader workers the skip was cleared only in the workers' copies: every later pass skipped
    # again (an inexact resume, or a hang when the skip covered a whole pass), and the short last batch
    # was dropped
    from torch.utils.data import DataLoader

    from mixprec import Accelerator

    stream = ShardedStream(Numbers(11), batch_size=4)
    accelerator = Accelerator(verbose=False)
    loader = accelerator.prepare(DataLoader(stream, batch_size=4, num_workers=workers, collate_fn=default_collate))
    stream.skip_batches(2)
    first, second = _first_column(loader), _first_column(loader)
    assert first == [[8, 9, 10]]
    assert second == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


class Reshuffled(Numbers):
    """A stream whose order depends on its epoch, as a ``datasets`` stream's ``shuffle``."""

    epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist():
            yield {"input_ids": torch.full((SEQ,), i % VOCAB), "labels": torch.full((SEQ,), (i + 1) % VOCAB)}


def test_a_stream_that_reshuffles_per_pass_gets_each_pass_and_resumes_into_the_same_order(tmp_path):
    # set_epoch was never called: every pass replayed the first pass's order (HF reshuffles)
    from mixprec import TrainerCallback

    class Crash(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 5:  # checkpoint-5 landed: inside the second pass
                raise RuntimeError("crash")

    def run(out, callbacks=(), resume=None):
        stream = Reshuffled(12)
        passes = []
        stream.set_epoch = lambda epoch: passes.append(epoch) or Reshuffled.set_epoch(stream, epoch)
        args = quiet_args(out, max_steps=9, per_device_train_batch_size=4, save_steps=5, save_strategy="steps")
        trainer = Trainer(make_model(), args, train_dataset=stream, callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=resume)
        return flat_params(trainer.model), passes

    whole, passes = run(tmp_path / "whole")
    assert passes == [0, 1, 2]
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "cut", [Crash()])
    resumed, passes = run(tmp_path / "cut", resume=True)
    assert passes == [1, 2]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


# -- reporting ---------------------------------------------------------------------------------------------


def test_report_to_mlflow_logs_params_and_metrics_to_a_local_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mixprec-test")
    args = quiet_args(tmp_path, max_steps=4, logging_steps=2, report_to=["mlflow"], run_name="r1")
    Trainer(make_model(), args, train_dataset=make_examples(32)).train()
    client = mlflow.tracking.MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("mixprec-test").experiment_id])[0]
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "5e-05"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4]


def test_report_to_wandb_offline_writes_a_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # its core's debug logs too, into this test's folder, never the home folder (issue 29)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    home_logs = Path.home() / ".cache" / "wandb"
    before = set(home_logs.rglob("core-debug-*.log"))
    args = quiet_args(tmp_path, max_steps=2, logging_steps=1, report_to="wandb")
    Trainer(make_model(), args, train_dataset=make_examples(16)).train()
    runs = list((Path(args.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    # wandb's core service starts once per process, with the cache folder of whichever run started it (this
    # one's, or the session's from conftest): either way, nothing new in the home folder
    assert set(home_logs.rglob("core-debug-*.log")) == before


def test_a_missing_reporter_package_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match="pip install mlflow"):
        Trainer(make_model(), quiet_args(tmp_path, report_to="mlflow"), train_dataset=make_examples(8))


# -- checkpoint-N folders for from_pretrained --------------------------------------------------------------


def test_checkpoint_folders_hold_config_json_for_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    rows = [{"input_ids": e["input_ids"], "labels": e["input_ids"]} for e in make_examples(8)]
    args = quiet_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(model, args, train_dataset=rows).train()
    folder = Path(args.output_dir) / "checkpoint-2"
    assert json.loads((folder / "config.json").read_text())["n_embd"] == 16
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


@pytest.mark.distributed
def test_a_stream_under_torchrun_gives_each_process_its_own_examples(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    script = Path(__file__).with_name("trainer_stream_torchrun_script.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    seen = [r["seen"] for r in ranks]
    assert seen[0] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27, 32, 33, 34, 35]
    assert seen[1] == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31, 36, 37, 38, 39]
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP kept them in step


def test_cli_train_gradient_checkpointing_flag(tmp_path, monkeypatch):
    from mixprec.cli.main import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    seen = []
    monkeypatch.setattr(GPT, "gradient_checkpointing_enable", lambda self, **kw: seen.append(kw))
    args = [
        "train",
        "--data",
        str(corpus),
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--max-steps",
        "1",
        "--precision",
        "fp32",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    assert main([*args, "--gradient-checkpointing"]) == 0
    assert seen == [{"gradient_checkpointing_kwargs": None}]
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["training_arguments"]["gradient_checkpointing"] is True


# -- logging_nan_inf_filter -------------------------------------------------------------------------------------


class PoisonedSteps(Trainer):
    """Training losses are real, except on the listed optimizer steps, where the loss is made NaN."""

    def __init__(self, *args, poisoned, **kwargs):
        super().__init__(*args, **kwargs)
        self.poisoned = set(poisoned)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs)
        if model.training and self.state.global_step + 1 in self.poisoned:
            loss = loss * float("nan")
        return loss


@pytest.mark.parametrize("nan_filter", [True, False])
def test_nan_inf_filter_keeps_non_finite_losses_out_of_the_logs_and_says_so(tmp_path, nan_filter):
    # steps 1-2 NaN (the first window has no finite loss), step 5 NaN (a window with a finite one)
    args = quiet_args(tmp_path, max_steps=6, logging_steps=2, logging_nan_inf_filter=nan_filter)
    trainer = PoisonedSteps(make_model(), args, train_dataset=make_examples(48), poisoned=[1, 2, 5])
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    losses = [e["loss"] for e in logged]
    if nan_filter:
        assert all(math.isfinite(x) for x in losses)
        assert [e.get("nonfinite_losses", 0) for e in logged] == [2, 0, 1]
        assert losses[0] == 0.0  # no finite loss yet: HF's stand-in, marked by the count above
        assert losses[2] > 0.0  # step 6's loss alone (step 5's NaN left out)
    else:
        assert math.isnan(losses[0]) and math.isnan(losses[2]) and math.isfinite(losses[1])
        assert all("nonfinite_losses" not in e for e in logged)


# -- memory metrics (skip_memory_metrics=False) ---------------------------------------------------------------


class HoldsMemory(Trainer):
    """Keeps a 64 MiB buffer alive from its first evaluation batch on: a planted allocation of the eval stage."""

    held = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training and HoldsMemory.held is None:
            HoldsMemory.held = torch.ones(16 * 1024 * 1024)  # 64 MiB, touched (resident)
        return super().compute_loss(model, inputs, return_outputs=return_outputs)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the CPU peak needs Linux's clear_refs")
def test_memory_metrics_per_stage_as_hf_names_them(tmp_path):
    data = make_examples(16)
    trainer = HoldsMemory(
        make_model(),
        quiet_args(tmp_path, max_steps=2, skip_memory_metrics=False),
        train_dataset=data,
        eval_dataset=data,
    )
    metrics = trainer.train().metrics
    for stage in ("init", "train"):  # init's are reported with the first train()
        assert isinstance(metrics[f"{stage}_mem_cpu_alloc_delta"], int)
        assert metrics[f"{stage}_mem_cpu_peaked_delta"] >= 0
    assert "train_mem_cpu_alloc_delta" in trainer.state.log_history[-1]  # logged with the run's last entry
    ev = trainer.evaluate()
    assert ev["eval_mem_cpu_alloc_delta"] >= 60 * 2**20  # the planted 64 MiB stays held
    assert "init_mem_cpu_alloc_delta" not in trainer.train().metrics  # only with the first train()
    assert "test_mem_cpu_alloc_delta" in trainer.predict(data).metrics
    HoldsMemory.held = None
    quiet = Trainer(make_model(), quiet_args(tmp_path, max_steps=1), train_dataset=data, eval_dataset=data)
    assert not any("_mem_" in k for k in [*quiet.train().metrics, *quiet.evaluate()])  # HF's default: off


# -- include_num_input_tokens_seen ------------------------------------------------------------------------------


class MaskedLM(torch.nn.Module):
    """trainer_utils' model, taking HF's attention_mask (so the Trainer keeps it in the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(dropout=0.0)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.inner(input_ids, labels=labels)


def padded_examples(n: int) -> list[dict[str, torch.Tensor]]:
    examples = make_examples(n)
    for i, ex in enumerate(examples):
        ex["attention_mask"] = (torch.arange(SEQ) < SEQ - i % 3).long()  # 0, 1 or 2 padding positions
    return examples


@pytest.mark.parametrize("mode", ["all", "non_padding", "no"])
def test_num_input_tokens_seen_counts_as_hf_and_survives_a_resume(tmp_path, mode):
    data = padded_examples(24)
    kwargs = dict(per_device_train_batch_size=4, include_num_input_tokens_seen=mode, logging_steps=2)
    trainer = Trainer(
        MaskedLM(), quiet_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, **kwargs), train_dataset=data
    )
    trainer.train()
    seen = trainer.state.num_input_tokens_seen
    if mode == "no":
        assert seen == 0 and all("num_input_tokens_seen" not in e for e in trainer.state.log_history)
        return
    if mode == "all":
        assert seen == 4 * 4 * SEQ
    else:
        assert 4 * 4 * (SEQ - 2) <= seen < 4 * 4 * SEQ  # the padding is left out
    logged = [e["num_input_tokens_seen"] for e in trainer.state.log_history if "loss" in e]
    assert logged[-1] == seen and logged == sorted(logged)
    resumed = Trainer(MaskedLM(), quiet_args(tmp_path, max_steps=4, **kwargs), train_dataset=data)
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert 0 < state["num_input_tokens_seen"] < seen and resumed.state.num_input_tokens_seen == seen


def test_an_unknown_token_count_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"TrainingArguments\(include_num_input_tokens_seen='some'"):
        TrainingArguments(include_num_input_tokens_seen="some")


# -- log_level ---------------------------------------------------------------------------------------------------


@pytest.fixture
def restore_mixprec_logger():
    import logging

    logger, hf = logging.getLogger("mixprec"), logging.getLogger("transformers")
    levels = logger.level, hf.level
    yield logger
    logger.setLevel(levels[0])
    hf.setLevel(levels[1])


def test_log_level_sets_the_library_loggers_level_as_hf_sets_transformers(tmp_path, restore_mixprec_logger):
    import logging

    from mixprec import TrainerCallback
    from mixprec.trainer.hf_loggers import hf_logger
    from trainer_utils import captured_records

    class Twice(TrainerCallback):
        pass

    def build(**kwargs):  # a second callback of one class: mixprec warns, as HF does
        return Trainer(
            make_model(), quiet_args(tmp_path, **kwargs), train_dataset=make_examples(8), callbacks=[Twice, Twice]
        )

    with captured_records(hf_logger("trainer_callback")) as records:
        build(log_level="error")
        assert not [r for r in records if "Twice" in r.getMessage()]
        assert restore_mixprec_logger.level == logging.ERROR
        build(log_level="warning")
        assert [r for r in records if "Twice" in r.getMessage()]
    restore_mixprec_logger.setLevel(logging.INFO)
    build()  # "passive" (the default) leaves the level as the application set it
    assert restore_mixprec_logger.level == logging.INFO
    with pytest.raises(ValueError, match=r"TrainingArguments\(log_level='loud'"):
        TrainingArguments(log_level="loud")
