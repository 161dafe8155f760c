"""Sharded (DCP) checkpoints across process counts (launched by test_elastic_sharded.py, under torchrun or as a
plain process; not collected by pytest).

    python sharded_worker.py save OUT     an FSDP2 model: save_sharded into OUT/sharded, and write the
                                          full weights to OUT/full.safetensors (the main process)
    python sharded_worker.py load OUT SRC a fresh FSDP2 model (other weights) loads SRC/sharded; its full
                                          weights go to OUT/loaded.safetensors
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from mixprec import Accelerator  # noqa: E402
from mixprec.checkpoint import save_tensors  # noqa: E402
from mixprec.checkpoint.sharded import load_sharded, save_sharded  # noqa: E402
from trainer_utils import make_model  # noqa: E402


def full_weights(acc: Accelerator, model: torch.nn.Module, path: Path) -> None:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if acc.is_main_process:
        save_tensors(state, path)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    mode, out = argv[0], Path(argv[1])
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
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
