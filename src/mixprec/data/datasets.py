"""Fixed-length training examples cut from a token stream."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class CausalLMDataset(Dataset):
    """Chunks of ``seq_len`` tokens as ``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}``.

    ``labels`` equals ``input_ids``: the model shifts them (Hugging Face convention), so a chunk trains
    ``seq_len - 1`` next-token predictions. ``stride`` defaults to ``seq_len``: chunks do not overlap, so each
    token is seen once per epoch; a smaller stride overlaps them (more, correlated examples). The tail that
    does not fill a chunk is dropped. The default ``DataLoader`` collate stacks the dicts into a batch dict.

    The tokens stay a uint8 tensor (1 byte per token); an item is widened to int64 only when read, so a
    3 MB corpus costs 3 MB, not 24. Items are views plus a copy on the host: no device work, no sync.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int | None = None, *, split: str = "corpus"):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor of token ids (e.g. from mixprec.data.split_train_val)")
        if tokens.is_floating_point():
            raise ValueError(f"tokens must hold integer ids, got dtype {tokens.dtype}")
        if not isinstance(seq_len, int) or seq_len < 2:
            # one token gives no next-token target after the shift
            raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        stride = seq_len if stride is None else stride
        if not isinstance(stride, int) or stride <= 0:
            raise ValueError(f"stride must be a positive integer or None, got {stride!r}")
        if len(tokens) < seq_len:
            raise ValueError(
                f"the {split} has {len(tokens)} tokens, fewer than one sequence of seq_len={seq_len}; "
                f"use a larger corpus or --seq-len <= {max(len(tokens), 2)}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride
        self._len = (len(tokens) - seq_len) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"CausalLMDataset index {index} out of range for {self._len} chunks")
        start = index * self.stride
        ids = self.tokens[start : start + self.seq_len].long()
        # labels is its own tensor: a collator that writes -100 into labels must not change input_ids
        return {"input_ids": ids, "labels": ids.clone()}

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the chunks (what one epoch reads)."""
        return (self._len - 1) * self.stride + self.seq_len
