"""What the migration pairs train: a small MLP regression, and a probe of the dtype its first layer computed in."""

from __future__ import annotations

import torch
from torch import nn


def toy_model_and_data(n: int = 256, width: int = 32) -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 64), nn.GELU(), nn.Linear(64, 1))
    x = torch.randn(n, width)
    y = x[:, :4].sum(1, keepdim=True)
    batches = [{"inputs": x[i : i + 32], "targets": y[i : i + 32]} for i in range(0, n, 32)]
    return model, batches


def computed_dtypes(model: nn.Module) -> set[torch.dtype]:
    """The dtypes model[0]'s output took, filled in as the model runs."""
    seen: set[torch.dtype] = set()
    model[0].register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    return seen
