"""CausalLMDataset: fixed-length chunks the default DataLoader batches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from mixprec.data import CausalLMDataset


def tokens(n: int) -> torch.Tensor:
    return (torch.arange(n) % 256).to(torch.uint8)


def test_non_overlapping_chunks_cover_each_token_once():
    ds = CausalLMDataset(tokens(100), seq_len=16)
    assert len(ds) == 6  # 96 tokens in chunks, the 4-token tail dropped
    assert ds.num_tokens == 96
    seen = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    assert torch.equal(seen, tokens(96).long())


def test_items_are_long_input_ids_and_labels_of_seq_len():
    ds = CausalLMDataset(tokens(64), seq_len=16)
    item = ds[1]
    assert set(item) == {"input_ids", "labels"}
    assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
    assert item["input_ids"].shape == (16,)
    assert torch.equal(item["labels"], item["input_ids"])  # the model shifts
    item["labels"][0] = -100  # masking labels must not corrupt the inputs
    assert item["input_ids"][0] == 16
    assert torch.equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_stride_overlaps_chunks():
    ds = CausalLMDataset(tokens(20), seq_len=8, stride=4)
    assert len(ds) == 4  # starts 0, 4, 8, 12
    assert ds[1]["input_ids"][0] == 4 and ds[3]["input_ids"][-1] == 19


def test_exactly_one_sequence_is_enough_and_less_is_refused_with_the_fix():
    assert len(CausalLMDataset(tokens(16), seq_len=16)) == 1
    with pytest.raises(ValueError, match=r"validation has 10 tokens.*seq_len=16.*--seq-len <= 10"):
        CausalLMDataset(tokens(10), seq_len=16, split="validation")
    with pytest.raises(ValueError, match="seq_len"):
        CausalLMDataset(tokens(10), seq_len=1)
    with pytest.raises(ValueError, match="stride"):
        CausalLMDataset(tokens(10), seq_len=4, stride=0)
    with pytest.raises(ValueError, match="1-D"):
        CausalLMDataset(tokens(10).view(2, 5), seq_len=4)


def test_default_collate_stacks_the_dicts_into_a_batch():
    ds = CausalLMDataset(tokens(200), seq_len=16)
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][2], ds[2]["input_ids"])
