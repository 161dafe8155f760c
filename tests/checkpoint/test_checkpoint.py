"""mixprec.checkpoint: atomic folders, safe formats, RNG capture."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mixprec.checkpoint import (
    CheckpointError,
    UnsafeCheckpointError,
    atomic_dir,
    begin,
    commit,
    load_json,
    load_tensors,
    load_torch,
    recover,
    rng_state,
    save_json,
    save_tensors,
    save_torch,
    set_rng_state,
)


def test_atomic_dir_appears_complete_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        save_json({"v": 1}, tmp / "a.json")
        assert not target.exists()  # nothing visible while writing
    assert load_json(target / "a.json") == {"v": 1}
    with pytest.raises(RuntimeError, match="killed"), atomic_dir(target) as tmp:
        save_json({"v": 2}, tmp / "a.json")
        raise RuntimeError("killed mid-save")
    assert load_json(target / "a.json") == {"v": 1}  # the old one, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # and no litter


def test_atomic_dir_replaces_an_existing_folder(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        save_json(1, tmp / "old-only.json")
    with atomic_dir(target) as tmp:
        save_json(2, tmp / "new.json")
    assert sorted(p.name for p in target.iterdir()) == ["new.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_every_crash_point_of_commit_leaves_a_loadable_state(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        save_json("old", tmp / "v.json")
    # A crash before commit: the temporary folder is litter, cleaned by the next begin().
    tmp = begin(target)
    save_json("new", tmp / "v.json")
    assert load_json(target / "v.json") == "old"
    # A crash between commit's renames: no target, a complete .ckpt.old; recover() puts it back.
    os.rename(target, tmp_path / ".ckpt.old")
    recover(target)
    assert load_json(target / "v.json") == "old"
    # A crash after the second rename: the new target and a stale .old; recover() removes the .old.
    (tmp_path / ".ckpt.old").mkdir()
    recover(target)
    assert not (tmp_path / ".ckpt.old").exists()
    commit(begin(target), target)  # begin() also cleared the first crash's temporary folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_tensors_round_trip_with_tied_weights(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2
    model = torch.nn.Sequential(emb, head)
    save_tensors(model.state_dict(), tmp_path / "m.safetensors")
    loaded = load_tensors(tmp_path / "m.safetensors")
    assert loaded.keys() == model.state_dict().keys()
    assert loaded["0.weight"] is loaded["1.weight"]  # stored once, restored tied
    fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh[0].weight, emb.weight)


def test_tensors_of_overlapping_views_and_odd_layouts(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    state = {"t": base.t(), "row": base[1], "int": torch.arange(3), "half": torch.ones(2, dtype=torch.float16)}
    save_tensors(state, tmp_path / "x.safetensors", metadata={"step": 3})
    loaded = load_tensors(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())


def test_bad_tensor_files_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'step' is a int, not a tensor"):
        save_tensors({"step": 3}, tmp_path / "x.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_tensors(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        load_tensors(tmp_path / "missing.safetensors")


def test_torch_state_round_trip(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    save_torch(optimizer.state_dict(), tmp_path / "opt.pt")
    loaded = load_torch(tmp_path / "opt.pt")
    assert loaded["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(loaded["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_save_torch_refuses_what_could_not_be_loaded_back(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['fn'\] is a builtin_function_or_method"):
        save_torch({"fn": print}, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > " + str(_MARKER),))


_MARKER = Path("/tmp/mixprec-checkpoint-test-payload")


def test_a_booby_trapped_pickle_is_refused_without_running(tmp_path: Path) -> None:
    _MARKER.unlink(missing_ok=True)
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"state": _Payload()}, f, protocol=2)
    torch.save({"ok": _Payload.__name__}, tmp_path / "fine.pt")
    with pytest.raises(UnsafeCheckpointError, match="refusing to load .*evil.pt"):
        load_torch(tmp_path / "evil.pt")
    assert not _MARKER.exists()
    assert load_torch(tmp_path / "fine.pt") == {"ok": "_Payload"}


def test_json_round_trip_and_bad_json(tmp_path: Path) -> None:
    save_json({"scale": float("inf"), "steps": [1, 2]}, tmp_path / "a.json")
    assert load_json(tmp_path / "a.json") == {"scale": float("inf"), "steps": [1, 2]}
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_json(tmp_path / "b.json")
    with pytest.raises(TypeError):
        save_json({"x": object()}, tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


def test_rng_state_restores_every_generator(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leave a cached gaussian in numpy's state
    save_torch(rng_state(), tmp_path / "rng.pt")
    first = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    set_rng_state(load_torch(tmp_path / "rng.pt"))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == first
