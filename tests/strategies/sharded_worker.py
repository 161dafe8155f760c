"""Sharded (DCP) checkpoints across process counts (launched by test_elastic_sharded.py, under torchrun or as a
plain process; not collected by pytest).

    python sharded_worker.py save OUT     an FSDP2 model: save_sharded into OUT/sharded, and write the
                                          full weights to OUT/full.safetensors (the main process)
    python sharded_worker.py load OUT SRC a fresh FSDP2 model (other weights) loads SRC/sharded; its full
                                          weights go to OUT/loaded.safetensors
    python sharded_worker.py state-save OUT
                                          Accelerator(fsdp_state_dict_type="sharded"): two fp16 AdamW steps,
                                          save_state(OUT/state); the full weights and optimizer state go to
                                          OUT/full.safetensors and OUT/optimizer.pt (the main process)
    python sharded_worker.py state-load OUT SRC
                                          a fresh model and optimizer load_state(SRC/state), then write the
                                          same two files into OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Accelerator  # noqa: E402
from mixprec.checkpoint import save_tensors  # noqa: E402
from mixprec.checkpoint.sharded import load_sharded, save_sharded  # noqa: E402
from trainer_utils import leave, make_examples, make_model  # noqa: E402


def full_weights(acc: Accelerator, model: torch.nn.Module, path: Path) -> None:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if acc.is_main_process:
        save_tensors(state, path)


def full_state(acc: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path) -> None:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_weights(acc, model, out / "full.safetensors")
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if acc.is_main_process:
        torch.save(state, out / "optimizer.pt")


def state_round_trip(mode: str, out: Path, src: Path | None) -> None:
    acc = Accelerator(
        cpu=True, distributed="fsdp", fsdp_state_dict_type="sharded", mixed_precision="fp16", verbose=False
    )
    # a dict output: FSDP2 re-gathers parameters for the backward through the output's pytree
    model = make_model(seed=0 if mode == "state-save" else 1, dropout=0.0, returns="dict")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    if mode == "state-save":
        for batch in make_examples(2 * acc.num_processes, seed=acc.process_index)[:2]:
            acc.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])["loss"])
            optimizer.step()
            optimizer.zero_grad()
        acc.save_state(out / "state")
    else:
        assert src is not None
        acc.load_state(src / "state")
    full_state(acc, model, optimizer, out)
    leave(acc)  # end_training, then exit without the interpreter's teardown (trainer_utils)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    mode, out = argv[0], Path(argv[1])
    if mode.startswith("state-"):
        state_round_trip(mode, out, Path(argv[2]) if len(argv) > 2 else None)
        return
    acc = Accelerator(cpu=True, distributed="fsdp", verbose=False)
    if mode == "save":
        # seed 0's weights; the loader's model starts from seed 1's, so a load that did nothing would show
        model = acc.prepare(make_model(seed=0, dropout=0.0))
        save_sharded(model, out / "sharded")
        full_weights(acc, model, out / "full.safetensors")
    else:
        model = acc.prepare(make_model(seed=1, dropout=0.0))
        load_sharded(model, Path(argv[2]) / "sharded")
        full_weights(acc, model, out / "loaded.safetensors")
    leave(acc)  # end_training, then exit without the interpreter's teardown (trainer_utils)


if __name__ == "__main__":
    main(sys.argv[1:])
