"""What the built-in GPT's forward returns: :class:`CausalLMOutput`, read the ways Hugging Face code reads a
``ModelOutput`` (attribute, key, index), and a pytree node so tree-maps and DDP see its tensors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.utils._pytree


@dataclass
class CausalLMOutput:
    """What :meth:`GPT.forward` returns, readable the three ways Hugging Face code reads a ModelOutput.

    ``out.loss``, ``out["loss"]`` and ``out[0]`` all work. As in ``transformers``, fields that are None are
    left out of the tuple and key views: without labels, ``out[0]`` is the logits and ``out["loss"]`` raises
    KeyError. Iterating yields the values (tuple-like), unlike ``transformers`` which yields the keys.
    """

    loss: torch.Tensor | None = None
    """Mean fp32 cross entropy of next-token prediction; None when no labels were given."""
    logits: torch.Tensor | None = None
    """(batch, seq, vocab) scores, in the autocast dtype when run under autocast."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, getattr(self, k)) for k in self.keys()]

    def to_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, k) for k in self.keys())

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.to_tuple())

    def __len__(self) -> int:
        return len(self.keys())


# A pytree node, as transformers does for ModelOutput: DDP (find_unused_parameters / static_graph) flattens a
# module's output with torch.utils._pytree to route its tensors through its backward hook; an unregistered
# dataclass would be one opaque leaf and those tensors would bypass it.
torch.utils._pytree.register_dataclass(CausalLMOutput)
