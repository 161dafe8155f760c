"""What users run on a GPU, end to end, kept small: the Accelerator and the Trainer in every low precision,
FSDP2 on one GPU, a checkpoint moved between GPU and CPU, ``mixprec diagnose`` / ``mixprec bench``, and the
watch's host syncs. Marked ``gpu``: conftest skips them without CUDA (issue 28 asked for them).
"""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch

from conftest import make_batches, make_tiny_lm
from mixprec import Accelerator, DistributedType, Trainer, TrainingArguments
from mixprec.watch import PrecisionWatch
from trainer_utils import make_examples, make_model

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# torch's own message for a synchronizing call under set_sync_debug_mode("warn"); its other warning, "Synchronization
# debug mode is a prototype feature ...", is not a sync (it made the scaler's sync test count one, issue 28)
SYNC_WARNING = "called a synchronizing CUDA operation"
# (precision, dtype of the Linear outputs): fp8's are bf16, its matmuls fp8
LOW_PRECISIONS = [
    ("fp16", torch.float16),
    ("bf16", torch.bfloat16),
    ("bf16-pure", torch.bfloat16),
    ("fp8", torch.bfloat16),
]


def _needs(precision: str) -> None:
    if precision.startswith("fp8"):
        pytest.importorskip("torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("fp8 matmuls need compute capability 8.9+")


@contextlib.contextmanager
def count_syncs():
    """The host syncs torch's sync detector reports inside the block (a list, filled on exit)."""
    found: list[str] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(str(w.message) for w in caught if SYNC_WARNING in str(w.message))


def _fp8_layers(model: torch.nn.Module) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def _linear_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    return seen


@pytest.mark.parametrize(("precision", "dtype"), LOW_PRECISIONS, ids=[p for p, _ in LOW_PRECISIONS])
def test_accelerator_trains_on_cuda_in(precision, dtype):
    _needs(precision)
    model = make_tiny_lm()  # widths 32 and 16: aligned for fp8, but under its size thresholds
    acc = Accelerator(mixed_precision=precision, verbose=False)
    if precision == "fp8":
        from mixprec.precision.fp8_layers import Fp8LayerFilter

        acc.precision.layer_filter = Fp8LayerFilter(skip_small=False)  # fp8 on these small layers, to test it
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert _fp8_layers(model) == (2 if precision == "fp8" else 0)
    seen = _linear_dtypes(model)  # after prepare: fp8 swapped the Linear modules for torchao's
    losses = []
    for batch in make_batches(30):
        out = model(batch["input_ids"].to(acc.device), labels=batch["labels"].to(acc.device))
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.detach())
    losses = torch.stack(losses).tolist()
    assert acc.device.type == "cuda" and acc.mixed_precision == precision and seen == {dtype}
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    assert acc.scaler.is_enabled() == (precision == "fp16")


@pytest.mark.parametrize(("precision", "dtype"), LOW_PRECISIONS, ids=[p for p, _ in LOW_PRECISIONS])
def test_trainer_trains_on_cuda_in(tmp_path, precision, dtype):
    _needs(precision)
    # fp8: a hidden layer wide enough for the default layer filter (1088 > 1024 outputs); the head stays bf16
    # (the dtype hooks see the modules that stay nn.Linear: fp8 replaces the others)
    model = make_model(dropout=0.0, width=1088 if precision == "fp8" else 32)
    seen = _linear_dtypes(model)
    lr = 3e-3 if precision == "fp8" else 3e-2
    args = TrainingArguments(
        output_dir=str(tmp_path),
        precision=precision,
        max_steps=40,
        learning_rate=lr,
        logging_steps=10,
        disable_tqdm=True,
        save_plots=False,
        save_strategy="no",
        report_to="none",
    )
    trainer = Trainer(model, args, train_dataset=make_examples(128))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert seen == {dtype} and next(model.parameters()).device.type == "cuda"
    assert _fp8_layers(model) == (1 if precision == "fp8" else 0)
    assert losses[-1] < 0.7 * losses[0], losses


def test_fsdp2_on_one_gpu_trains_in_bf16():
    acc = Accelerator(mixed_precision="bf16", distributed="fsdp", verbose=False)
    try:
        model = make_tiny_lm()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for batch in make_batches(30):
            out = model(batch["input_ids"].to(acc.device), labels=batch["labels"].to(acc.device))
            acc.backward(out.loss)
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        assert acc.distributed_type == DistributedType.FSDP and acc.num_processes == 1
        assert type(next(model.parameters())).__name__ == "DTensor"  # fully_shard took the parameters
        assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    finally:
        acc.end_training()  # the process group: later tests run without one


def _state(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    opt_state = opt.state_dict()["state"]
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "opt": {(i, k): torch.as_tensor(v).cpu().clone() for i, s in opt_state.items() for k, v in s.items()},
        "scale": acc.scaler.get_scale(),
        "steps": acc.scaler.record.steps,
    }


def _fp16_run(cpu: bool):
    torch.manual_seed(0)
    model = make_tiny_lm()
    acc = Accelerator(mixed_precision="fp16", cpu=cpu, verbose=False, scaler_kwargs={"growth_interval": 2})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return acc, model, opt


def _train(acc, model, opt, batches) -> None:
    for batch in batches:
        acc.backward(model(batch["input_ids"].to(acc.device), labels=batch["labels"].to(acc.device)).loss)
        opt.step()
        opt.zero_grad()


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu_and_back_bit_exact(tmp_path):
    batches = make_batches(6)
    acc, model, opt = _fp16_run(cpu=False)
    _train(acc, model, opt, batches[:3])
    saved = _state(acc, model, opt)
    acc.save_state(tmp_path / "gpu")
    _train(acc, model, opt, batches[3:])
    want = _state(acc, model, opt)  # the uninterrupted GPU run

    cpu_acc, cpu_model, cpu_opt = _fp16_run(cpu=True)
    cpu_acc.load_state(tmp_path / "gpu")
    assert _equal(_state(cpu_acc, cpu_model, cpu_opt), saved)  # every bit arrived on the CPU
    assert next(cpu_model.parameters()).device.type == "cpu"
    cpu_acc.save_state(tmp_path / "cpu")
    _train(cpu_acc, cpu_model, cpu_opt, batches[3:4])  # and it trains there

    back, back_model, back_opt = _fp16_run(cpu=False)
    back.load_state(tmp_path / "cpu")
    assert _equal(_state(back, back_model, back_opt), saved)
    _train(back, back_model, back_opt, batches[3:])
    assert _equal(_state(back, back_model, back_opt), want)  # the same run as if never moved


def _equal(a: dict, b: dict) -> bool:
    same = a["scale"] == b["scale"] and a["steps"] == b["steps"] and a["params"].keys() == b["params"].keys()
    same = same and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    return same and a["opt"].keys() == b["opt"].keys() and all(torch.equal(a["opt"][k], b["opt"][k]) for k in a["opt"])


def test_diagnose_runs_on_cuda(tmp_path, capsys):
    from mixprec.cli.main import main

    corpus = tmp_path / "notes.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 200)
    argv = [
        "diagnose",
        "--data",
        str(corpus),
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--batches",
        "2",
        "--json",
        "--no-plot",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "on cuda" in captured.err and report["recommended_precision"] in ("bf16", "fp16")
    assert report["first_nonfinite"] is None


def test_bench_runs_on_cuda(capsys):
    from mixprec.cli.main import main

    argv = [
        "bench",
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--precisions",
        "fp32,fp16,bf16",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"].startswith("cuda")
    assert [r["precision"] for r in doc["results"]] == ["fp32", "fp16", "bf16"]
    assert all(r["peak_mem_bytes"] and r["peak_mem_bytes"] > 0 for r in doc["results"])


def _syncs_per_step(watch) -> list[int]:
    torch.manual_seed(0)
    model = make_tiny_lm()
    acc = Accelerator(mixed_precision="fp16", watch=watch, verbose=False)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    counts = []
    for i, batch in enumerate(make_batches(5)):
        ids, labels = batch["input_ids"].to(acc.device), batch["labels"].to(acc.device)
        with count_syncs() as syncs:
            acc.backward(model(ids, labels=labels).loss)
            opt.step()
            opt.zero_grad()
        if i >= 1:  # the first step allocates the optimizer state and the scale
            counts.append(len(syncs))
    if acc.watch is not None:
        acc.watch.close()
    return counts


def test_the_watch_adds_no_host_sync_between_samples_and_one_on_a_sample():
    plain = _syncs_per_step(None)
    assert max(plain) <= 1, plain  # the scaler's one read of its inf check
    assert _syncs_per_step(PrecisionWatch(every=1000)) == plain
    sampled = _syncs_per_step(PrecisionWatch(every=1))
    assert all(s <= p + 1 for s, p in zip(sampled, plain)), (sampled, plain)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_pure_optimizer_step_makes_no_host_sync(rounding):
    # issue 28: a host copy of each parameter's step count and a host read of the rounding key were syncs
    from mixprec.optim import Bf16AdamW

    params = [torch.nn.Parameter(torch.randn(n, device=CUDA).to(torch.bfloat16)) for n in (3000, 5, 700)]
    opt = Bf16AdamW(params, lr=0.1, rounding=rounding, bucket_elements=1024)  # several buckets, one split
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state made
    before = [p.detach().clone() for p in params]
    with count_syncs() as syncs:
        opt.step()
    assert syncs == []
    assert all(not torch.equal(a, p) for a, p in zip(before, params))
