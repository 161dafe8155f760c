"""accelerator/hf_weights.py: save_model writes the Hugging Face layout (one file or shards and an index) that
HF loaders read, leaves other files alone and never leaves an index naming a missing shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mixprec import Accelerator
from mixprec.accelerator.hf_weights import parse_size, split_shards
from mixprec.checkpoint import load_tensors, load_torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))


def _read_folder(folder: Path, safe: bool) -> dict[str, torch.Tensor]:
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    read = load_tensors if safe else load_torch
    index = folder / f"{stem}.{ext}.index.json"
    if not index.exists():
        return read(folder / f"{stem}.{ext}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(read(folder / name))
    return out


@pytest.mark.parametrize("safe", [True, False])
def test_one_file_or_shards_hold_exactly_the_weights(tmp_path: Path, safe: bool) -> None:
    acc = Accelerator(verbose=False)
    model = acc.prepare(_model())
    acc.save_model(model, tmp_path / "one", safe_serialization=safe)
    acc.save_model(model, tmp_path / "many", safe_serialization=safe, max_shard_size=300)
    stem = "model" if safe else "pytorch_model"
    assert len(list((tmp_path / "many").glob(f"{stem}-0000*-of-*"))) > 1
    index = json.loads(next((tmp_path / "many").glob("*.index.json")).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for folder in ("one", "many"):
        saved = _read_folder(tmp_path / folder, safe)
        assert saved.keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(saved[key], value, rtol=0, atol=0)


def test_safetensors_carry_the_format_transformers_checks(tmp_path: Path) -> None:
    from safetensors import safe_open

    Accelerator(verbose=False).save_model(_model(), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"


def test_a_resave_removes_stale_shards_and_index_but_keeps_other_files(tmp_path: Path) -> None:
    acc = Accelerator(verbose=False)
    model = _model()
    (tmp_path / "config.json").write_text("{}")
    acc.save_model(model, tmp_path, max_shard_size=200)
    assert (tmp_path / "model.safetensors.index.json").exists()
    acc.save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_sizes_parse_as_hf_does_and_bad_ones_name_the_argument() -> None:
    assert parse_size("10GB") == 10 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(100) == 100
    for bad in ("ten", "5XB", 0, -1):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_a_tensor_bigger_than_a_shard_gets_its_own_and_tied_weights_count_once() -> None:
    big, small = torch.zeros(100), torch.zeros(2)
    assert [list(s) for s in split_shards({"a": small, "b": big, "c": small}, 40)] == [["a"], ["b"], ["c"]]
    tied = torch.zeros(4)
    assert len(split_shards({"x": tied, "y": tied}, 16)) == 1


def test_get_state_dict_returns_the_full_weights(tmp_path: Path) -> None:
    acc = Accelerator(verbose=False)
    model = acc.prepare(_model())
    state = acc.get_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert acc.get_state_dict(model, unwrap=False).keys() == state.keys()


def test_weights_on_the_meta_device_are_refused_by_name(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'weight'.*meta device"):
        Accelerator(verbose=False).save_model(model, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("safe", [True, False])
def test_fsdp2_save_model_gathers_the_full_weights(tmp_path: Path, safe: bool) -> None:
    acc = Accelerator(distributed="fsdp", verbose=False)
    try:
        model = _model()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        model = acc.prepare(model)
        acc.save_model(model, tmp_path, safe_serialization=safe, max_shard_size=300)
        saved = _read_folder(tmp_path, safe)
        assert saved.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(saved[key], value, rtol=0, atol=0)  # full tensors, not shards
        assert acc.get_state_dict(model).keys() == expected.keys()
    finally:
        acc.end_training()
