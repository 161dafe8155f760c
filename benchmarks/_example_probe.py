"""Run one example script as ``python script.py ARGS`` would, and record what its training really computed.

    python -m benchmarks._example_probe OUT.json SCRIPT [ARGS...]

The probe sees the script from outside, the same way under transformers/accelerate and under mixprec, so the
benchmark's "precision really used" column is not what a library says it did but what its matmuls were: a
global forward hook counts the output dtype of every ``nn.Linear`` called with autograd on in training mode
(evaluation and ``no_grad`` forwards are left out), and keeps each training forward's ``loss`` (an HF
``ModelOutput``'s, the one value every script computes the same way). OUT.json is written when the script
ends, normally or not, so a crash still reports how far it got.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch


class Probe:
    def __init__(self) -> None:
        self.linear_dtypes: Counter[str] = Counter()
        self.losses: list[float] = []
        self._last_loss: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, args, output) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            self.linear_dtypes[str(output.dtype).removeprefix("torch.")] += 1
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        # A wrapper (DDP, a compiled or prepared model) returns its inner model's output: count that loss once.
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss is not self._last_loss:
            self._last_loss = loss
            self.losses.append(float(loss.detach().float()))  # host sync per step: fine on the CPU it runs on

    def report(self) -> dict:
        return {"linear_dtypes": dict(self.linear_dtypes), "losses": self.losses}


def main() -> None:
    out, script, *args = sys.argv[1:]
    probe = Probe()
    torch.nn.modules.module.register_module_forward_hook(probe)
    atexit.register(lambda: Path(out).write_text(json.dumps(probe.report())))
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` has it, in place of the probe's
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
