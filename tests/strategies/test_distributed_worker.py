"""The script tests/strategies/test_distributed.py launches with torchrun (2 processes, gloo). Not a test module itself.

Each process runs the scenarios below and writes ``rank<N>.json`` into the folder given as argv[1]; the
tests compare the files. Scenarios share one process group: a PartialState joins it first (as a distributed
inference script would), and every Accelerator finds it initialised and uses it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from mixprec import Accelerator, PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import SEQ, VOCAB, TinyLM  # noqa: E402
from trainer_utils import leave  # noqa: E402

N_SAMPLES = 36  # 2 processes x batch 4 = 8 per step: 4 full steps and a tail of 4 (split 2 + 2)
BATCH = 4
EPOCHS = 2


class IndexedTokens(Dataset):
    """The next-token task of conftest, each item carrying its index so the split can be checked."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": (self.ids[i] + 1) % VOCAB, "idx": torch.tensor(i)}


def build(accelerator: Accelerator, seed: int = 0, fused: bool = False):
    torch.manual_seed(seed)  # same init and the same shuffle seed in every scenario
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
    loader = DataLoader(IndexedTokens(), batch_size=BATCH, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def train(accelerator: Accelerator, model, optimizer, loader, scheduler, epochs: int = EPOCHS) -> dict:
    losses, indices = [], []
    for _ in range(epochs):
        seen = []
        for batch in loader:
            seen += batch["idx"].tolist()
            with accelerator.accumulate(model):
                loss = model(batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        indices.append(seen)
    return {"losses": losses, "indices": indices, "batches_per_epoch": len(loader)}


def full_params(accelerator: Accelerator, model) -> dict[str, list[float]] | None:
    state = accelerator._strategy.model_state_dict(model)
    return None if state is None else {k: v.float().flatten().tolist() for k, v in state.items()}


def inject_inf_on_rank1(accelerator: Accelerator, model, optimizer, loader, scheduler) -> dict:
    """A step whose gradient is inf on process 1 only: both must skip it, and keep the same scale."""
    batch = next(iter(loader))
    before = full_params(accelerator, model)
    lr_before = scheduler.get_last_lr()[0]
    loss = model(batch["input_ids"], labels=batch["labels"]).loss
    accelerator.backward(loss)
    if accelerator.process_index == 1:
        grad = next(p for p in model.parameters() if p.grad is not None).grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return {
        "skipped": accelerator.optimizer_step_was_skipped,
        "scale": accelerator.scaler.get_scale(),
        "unchanged": before == full_params(accelerator, model),
        "lr_unchanged": scheduler.get_last_lr()[0] == lr_before,
    }


def no_sync_grads() -> dict:
    """With accumulation, the first micro-batch keeps local gradients; the second all-reduces them."""
    accelerator = Accelerator(gradient_accumulation_steps=2, verbose=False)
    model, optimizer, loader, _ = build(accelerator)
    out = {}
    for i, batch in zip(range(2), loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
            grad = model.head.weight.grad.clone()
            both = accelerator.gather(grad[None])
            out[f"micro{i}_sync"] = accelerator.sync_gradients
            out[f"micro{i}_equal_across_ranks"] = bool(torch.equal(both[0], both[1]))
            optimizer.step()
            optimizer.zero_grad()
    return out


def local_sgd() -> dict:
    """accelerate's own LocalSGD over mixprec's Accelerator: two steps under ``model.no_sync()`` (each rank's
    weights drift on its own data), then the parameters averaged over the ranks (``local_sgd_steps=2``)."""
    from accelerate.local_sgd import LocalSGD

    accelerator = Accelerator(verbose=False)
    model, optimizer, loader, _ = build(accelerator)
    out = {"distributed_type": accelerator.distributed_type}
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as sgd:
        out["enabled"] = sgd.enabled
        for _, batch in zip(range(2), loader):
            accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
            optimizer.step()
            optimizer.zero_grad()
            out["before"] = accelerator.gather(model.head.weight.detach()[None]).tolist()
            sgd.step()
        out["after"] = accelerator.gather(model.head.weight.detach()[None]).tolist()
    return out


def scheduler_lrs() -> dict[str, float]:
    """The LR after one optimizer step of LambdaLR(1 - n/10), as accelerate's rule (num_processes advances per
    step) and as mixprec's Trainer sizes its schedule (in optimizer steps: one)."""
    out = {}
    for name, counts_optimizer_steps in (("accelerate", False), ("optimizer_steps", True)):
        accelerator = Accelerator(verbose=False, scheduler_counts_optimizer_steps=counts_optimizer_steps)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1 - n / 10)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        accelerator.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        scheduler.step()
        out[name] = scheduler.get_last_lr()[0]
    return out


def accumulated(distributed: str | None) -> dict[str, list[float]] | None:
    """Two optimizer steps of two micro-batches each (no_sync on the first of each pair)."""
    accelerator = Accelerator(gradient_accumulation_steps=2, distributed=distributed, verbose=False)
    model, optimizer, loader, scheduler = build(accelerator)
    for _, batch in zip(range(4), loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return full_params(accelerator, model)


def save_and_load(accelerator: Accelerator, objects, folder: Path, distributed: str | None) -> dict:
    model = objects[0]
    accelerator.save_state(folder)
    drawn = torch.rand(4).tolist()  # right after the save: the resumed process must draw the same
    saved = full_params(accelerator, model)
    fresh = Accelerator(mixed_precision=accelerator.mixed_precision, distributed=distributed, verbose=False)
    new_objects = build(fresh, seed=99)  # a different init, overwritten by load_state
    fresh.load_state(folder)
    return {
        "params_restored": full_params(fresh, new_objects[0]) == saved,
        "rng_restored": torch.rand(4).tolist() == drawn,
        "files": sorted(p.name for p in folder.iterdir()),
        "scale_restored": fresh.scaler.get_scale() == accelerator.scaler.get_scale(),
    }


def run_kind(distributed: str | None, precision: str, out: Path) -> dict:
    accelerator = Accelerator(mixed_precision=precision, distributed=distributed, verbose=False)
    objects = build(accelerator)
    result = train(accelerator, *objects)
    result["params"] = full_params(accelerator, objects[0])
    result["local_params"] = (
        {k: v.flatten().tolist() for k, v in objects[0].state_dict().items()} if distributed is None else None
    )
    result["kind"] = accelerator.distributed_type  # a str enum: "MULTI_CPU", "FSDP" in the JSON
    result["state_keys"] = sorted(objects[0].state_dict().keys())
    if precision == "fp16":
        result["inf"] = inject_inf_on_rank1(accelerator, *objects)
    result["state"] = save_and_load(accelerator, objects, out / f"state-{distributed}-{precision}", distributed)
    return result


def comm_run(distributed: str | None, comm: str) -> dict:
    """The fp32 scenario of run_kind, its gradients all-reduced (DDP) or reduce-scattered (FSDP2) in ``comm``."""
    accelerator = Accelerator(distributed=distributed, comm_dtype=comm, verbose=False)
    objects = build(accelerator)
    result = train(accelerator, *objects)
    return {"losses": result["losses"], "params": full_params(accelerator, objects[0])}


class Gain(torch.nn.Module):
    """y = x * w: elementwise, so autocast leaves it in fp32 and its gradient is fp32 until it meets the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def wire_overflow(comm: str) -> dict:
    """fp16 precision (loss scale 65536); rank 1's loss x 10: its scaled gradient (~6e5) is finite in fp32,
    past fp16's 65504 on an fp16 wire."""
    accelerator = Accelerator(mixed_precision="fp16", comm_dtype=comm, verbose=False)
    model = Gain()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.linspace(1.0, 2.0, 8)
    loss = model(x) * (10.0 if accelerator.process_index == 1 else 1.0)
    accelerator.backward(loss)
    finite = bool(model.w.grad.isfinite().all())
    optimizer.step()
    optimizer.zero_grad()
    return {
        "skipped": accelerator.optimizer_step_was_skipped,
        "finite_after_all_reduce": finite,
        "unchanged": bool((model.w == 1).all()),
        "scale": accelerator.scaler.get_scale(),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def auto_run(distributed: str | None = None) -> dict:
    os.environ["MIXPREC_AUTO_PREFILTER"] = "1"  # as a user's run: a mode emulated on this CPU is left out
    try:
        accelerator = Accelerator(mixed_precision="auto", distributed=distributed, verbose=False)
    finally:
        os.environ["MIXPREC_AUTO_PREFILTER"] = "0"
    model, optimizer, loader, scheduler = build(accelerator)
    for i, batch in enumerate(loader):
        accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
        optimizer.step()
        optimizer.zero_grad()
        if i == 1:
            break
    decision = accelerator.auto_decision
    params = torch.cat([_local(p).detach().flatten().float() for p in model.parameters()])
    return {
        "chosen": accelerator.mixed_precision,
        "source": decision.source,
        "excluded": decision.excluded,
        "params": params.tolist(),
    }


def auto_in_run(max_steps: int = 200) -> dict:
    """The race of "auto" as the training steps under DDP: every process runs each step in the same mode."""
    # max_steps sits above the race's own worst case (MAX_ROUNDS paired rounds of every candidate plus warm-ups): a
    # loaded machine keeps pairs undecided longer, and a cap of 60 ended the run before the race did
    os.environ["MIXPREC_AUTO_RACE"] = "in-run"
    try:
        accelerator = Accelerator(mixed_precision="auto", verbose=False)
        model, optimizer, loader, scheduler = build(accelerator)
        steps = 0
        while accelerator.auto_decision is None and steps < max_steps:
            for batch in loader:
                accelerator.backward(model(batch["input_ids"], labels=batch["labels"]).loss)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if accelerator.auto_decision is not None or steps >= max_steps:
                    break
    finally:
        del os.environ["MIXPREC_AUTO_RACE"]
    decision = accelerator.auto_decision
    params = torch.cat([_local(p).detach().flatten().float() for p in model.parameters()])
    return {
        "chosen": accelerator.mixed_precision,
        "source": decision and decision.source,
        "steps": steps,
        "race_steps": decision and decision.in_run_steps,
        "params": params.tolist(),
    }


def main() -> None:
    start = time.perf_counter()
    out = Path(sys.argv[1])
    results = {}
    state = PartialState()  # joins the group the torchrun environment describes
    with state.split_between_processes(list(range(5))) as share:
        results["split"] = share
    with state.split_between_processes({"x": torch.arange(5)}, apply_padding=True) as share:
        results["split_padded"] = state_gather(state, share["x"])
    first = Accelerator(verbose=False)  # finds the group initialised
    results["world"] = {"num_processes": first.num_processes, "backend": dist.get_backend()}
    results["uneven_gather"] = first.gather(torch.arange(first.process_index + 1)).tolist()
    rank = first.process_index
    results["metrics_objects"] = {  # text predictions and numbers: gathered as objects, as accelerate's
        "text": first.gather_for_metrics([f"text {rank}"] * (rank + 1)),
        "number": first.gather_for_metrics(rank + 0.5),
        "asked": [int(t) for t in first.gather_for_metrics([torch.tensor(rank)], use_gather_object=True)],
    }
    results["padded"] = padded_across(first)
    quiet = first.check_trigger()
    if first.process_index == 1:
        first.set_trigger()  # only rank 1 raises it: every rank sees it, then it is lowered everywhere
    results["trigger"] = [quiet, first.check_trigger(), first.check_trigger()]
    # "auto"'s agreement: rank 0's words for every rank, the race's own ("settled", "stop") as well as modes
    agree = first.strategy.agreement()
    results["agreed"] = agree(["bf16", "settled", "stop"] if first.is_main_process else ["fp32"])
    results["dispatched"] = dispatched()
    results["no_sync"] = no_sync_grads()
    results["local_sgd"] = local_sgd()
    results["scheduler_lrs"] = scheduler_lrs()
    results["accumulated"] = {"ddp": accumulated(None), "fsdp": accumulated("fsdp")}
    # "auto" races on the first DDP training step, every process in lockstep (a backward is a collective);
    # each would time it differently on a loaded machine: all take rank 0's measurement
    results["auto"] = auto_run()
    results["auto-fsdp"] = auto_run("fsdp")  # sharded: the trials' all-gathers must run in lockstep too
    results["auto-in-run"] = auto_in_run()  # the race as the training steps: each step one mode for all
    for distributed in (None, "fsdp"):
        for precision in ("fp32", "fp16"):
            t0 = time.perf_counter()
            results[f"{distributed or 'ddp'}-{precision}"] = run_kind(distributed, precision, out)
            results[f"{distributed or 'ddp'}-{precision}"]["seconds"] = time.perf_counter() - t0
    results["fsdp-bf16-pure"] = run_kind("fsdp", "bf16-pure", out)  # its Adam steps each process's own shard
    results["half-base"] = half_base_masters()
    # gradients on the wire in bf16/fp16: compared with ddp-fp32 / fsdp-fp32 above (same data, same init)
    results["comm"] = {
        f"{d or 'ddp'}-{c}": comm_run(d, c) for d, c in ((None, "bf16"), (None, "fp16"), ("fsdp", "bf16"))
    }
    results["comm_overflow"] = {c: wire_overflow(c) for c in ("fp16", "fp32")}
    results["seconds"] = time.perf_counter() - start
    (out / f"rank{first.process_index}.json").write_text(json.dumps(results))
    leave(first)


def half_base_masters() -> dict:
    """A frozen fp16 base with a trainable fp16 head under DDP fp16: each rank its own batches; the head's
    gradients are all-reduced on the model parameters, then copied to the fp32 masters (master_weights.py)."""
    accelerator = Accelerator(mixed_precision="fp16", verbose=False)
    torch.manual_seed(0)
    model = TinyLM().half()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
    frozen = model.embed.weight.detach().clone()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.head.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(100 + accelerator.process_index)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        accelerator.backward(model(ids, labels=(ids + 1) % VOCAB).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    master = optimizer.param_groups[0]["params"][0]
    return {
        "head": model.head.weight.detach().float().flatten().tolist(),
        "master": master.detach().flatten().tolist(),
        "dtypes": [str(model.head.weight.dtype), str(master.dtype)],
        "frozen_unchanged": bool(torch.equal(model.embed.weight, frozen)),
    }


def padded_across(acc: Accelerator) -> dict:
    """Rank r holds a (2, 3 + r) tensor of r + 1s: padded along dim 1 to 4 columns, then gathered."""
    t = torch.full((2, 3 + acc.process_index), acc.process_index + 1)
    nested = acc.pad_across_processes({"a": t, "b": [t[0]]}, dim=1, pad_index=-1)
    return {
        "after": acc.gather(acc.pad_across_processes(t, dim=1, pad_index=-100)).tolist(),
        "first": acc.gather(acc.pad_across_processes(t, dim=1, pad_index=-100, pad_first=True)).tolist(),
        "nested": [list(nested["a"].shape), nested["b"][0].tolist()],  # a 1-D tensor has no dim 1: as it is
        # dim=-1 counts from the end (a shorter rank's tensor came back 4-D)
        "last": acc.gather(acc.pad_across_processes(t, dim=-1, pad_index=-100)).tolist(),
    }


class Counting(torch.utils.data.IterableDataset):
    """A stream of 0..n-1, which only the main process can read in order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def dispatched() -> dict:
    """Each process's batches (as lists of sample ids) from loaders the main process reads and sends."""
    from mixprec import DataLoaderConfiguration

    out = {}
    accelerator = Accelerator(verbose=False)  # dispatch_batches=None: an IterableDataset is dispatched
    for n in (23, 17):  # 23: the last batch short; 17: a 1-sample tail folded into the step before it
        loader = accelerator.prepare(DataLoader(Counting(n), batch_size=4))
        out[f"stream{n}"] = [b.tolist() for b in loader]
    weighted = DataLoader(list(range(12)), batch_size=3, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 12, 12))
    config = DataLoaderConfiguration(dispatch_batches=True)
    loader = Accelerator(dataloader_config=config, verbose=False).prepare(weighted)  # a sampler it cannot split
    out["sampler"] = [b.tolist() for b in loader]
    dispatching = Accelerator(dataloader_config=config, verbose=False)
    words = dispatching.prepare(DataLoader(["a", "b", "c", "d"], batch_size=2))
    try:  # the main process cannot split strings: every process hears it, none waits for a batch
        out["bad_batch"] = [b for b in words]
    except TypeError as err:
        out["bad_batch"] = str(err)
    try:
        Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False), verbose=False).prepare(
            DataLoader(Counting(8), batch_size=2)
        )
        out["refused"] = None
    except TypeError as err:
        out["refused"] = str(err)
    return out


def state_gather(state: PartialState, share: torch.Tensor) -> list[int]:
    """Every process's padded share, gathered: equal lengths, so a plain all_gather takes them."""
    parts = [torch.empty_like(share) for _ in range(state.num_processes)]
    dist.all_gather(parts, share)
    return torch.cat(parts).tolist()


if __name__ == "__main__":
    main()
