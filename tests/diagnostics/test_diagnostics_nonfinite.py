"""The non-finite search names the first module, in execution order, forward or backward."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.diagnostics import find_first_nonfinite
from mixprec.diagnostics._precision import resolve_target
from mixprec.diagnostics.hooks import hooks_left

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.relu(self.b(torch.relu(self.a(x)))) * self.gain)
        return nn.functional.mse_loss(out, torch.zeros_like(out))  # fp32 under autocast, like a real loss


def _batch() -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.randn(16, 8, generator=torch.Generator().manual_seed(1))}]


def test_finite_model_reports_none_and_the_losses() -> None:
    torch.manual_seed(0)
    event, losses = find_first_nonfinite(Net(), _batch() * 2, resolve_target("fp16", CPU), 1024.0)
    assert event is None
    assert len(losses) == 2 and all(v == v for v in losses)


def test_backward_overflow_is_attributed_to_the_module_nearest_the_loss() -> None:
    torch.manual_seed(0)
    model = Net()
    # forward is fine in fp16; a loss scale of 2^30 makes d(loss)/d(head output) ~1e9: inf in fp16
    event, _ = find_first_nonfinite(model, _batch(), resolve_target("fp16", CPU), 2.0**30)
    assert event is not None
    assert (event.module, event.phase, event.dtype, event.what) == ("head", "backward", "float16", "output grad")
    assert hooks_left(model) == [] and all(not p._backward_hooks for p in model.parameters())


def test_forward_overflow_names_the_innermost_module_first() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)))
    with torch.no_grad():
        model[1][0].weight.mul_(1e5)  # the inner Linear's output exceeds 65504 under fp16

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).float().mean()

    event, _ = find_first_nonfinite(Wrap(), _batch(), resolve_target("fp16", CPU), 1.0)
    assert (event.module, event.phase) == ("net.1.0", "forward")  # not its parent "net.1" or "net"
    assert find_first_nonfinite(Wrap(), _batch(), resolve_target("bf16", CPU), 1.0)[0] is None
