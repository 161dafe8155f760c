"""accelerator/project.py + checkpoints.py: automatic checkpoint naming, its limit and iteration, the
save/load pre-hooks, and save_state's two weight formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mixprec import Accelerator, ProjectConfiguration


def _prepared(tmp_path: Path, **project) -> tuple[Accelerator, torch.nn.Module]:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, **project)
    acc = Accelerator(project_config=config, verbose=False)
    model = acc.prepare(torch.nn.Linear(3, 2))
    return acc, model


def test_automatic_names_count_up_and_the_limit_keeps_the_newest(tmp_path: Path) -> None:
    acc, _ = _prepared(tmp_path, total_limit=2)
    paths = [acc.save_state() for _ in range(4)]
    assert [p.name for p in paths] == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]
    assert acc.save_iteration == 4


def test_load_without_a_path_takes_the_newest_by_number_and_restores_the_iteration(tmp_path: Path) -> None:
    acc, model = _prepared(tmp_path)
    for value in range(11):  # checkpoint_10 sorts before checkpoint_2 as text: the number must decide
        with torch.no_grad():
            model.weight.fill_(value)
        acc.save_state()
    fresh, model2 = _prepared(tmp_path)
    assert fresh.save_iteration == 0
    fresh.load_state()
    assert torch.all(model2.weight == 10)
    assert fresh.save_iteration == 11  # the next save goes after the loaded one instead of colliding
    assert fresh.save_state().name == "checkpoint_11"


def test_an_existing_target_and_missing_paths_are_refused_with_the_fix(tmp_path: Path) -> None:
    acc, _ = _prepared(tmp_path)
    acc.save_state()
    acc.project_configuration.iteration = 0
    with pytest.raises(ValueError, match=r"checkpoint_0 already exists.*iteration"):
        acc.save_state()
    plain = Accelerator(verbose=False)
    with pytest.raises(ValueError, match="save_state\\(\\) needs a folder"):
        plain.save_state()
    with pytest.raises(ValueError, match="load_state\\(\\) needs a folder"):
        plain.load_state()
    empty, _ = _prepared(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint_<n> folder"):
        empty.load_state()


def test_project_configuration_fields_are_validated_and_logging_dir_follows() -> None:
    assert ProjectConfiguration(project_dir="p").logging_dir == "p"
    assert Accelerator(project_dir="q", verbose=False).logging_dir == "q"
    with pytest.raises(ValueError, match="total_limit"):
        ProjectConfiguration(total_limit=0)
    with pytest.raises(ValueError, match="iteration"):
        ProjectConfiguration(iteration=-1)


@pytest.mark.parametrize("safe", [True, False])
def test_both_weight_formats_round_trip_with_tied_weights(tmp_path: Path, safe: bool) -> None:
    acc = Accelerator(verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    model = acc.prepare(model)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    acc.save_state(tmp_path / "s", safe_serialization=safe)
    names = {p.name for p in (tmp_path / "s").iterdir()}
    assert ("model.safetensors" in names) is safe and ("pytorch_model.bin" in names) is not safe
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(tmp_path / "s")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)
    assert model[1].weight is model[0].weight


def test_hooks_add_files_inside_the_atomic_folder_and_can_be_removed(tmp_path: Path) -> None:
    acc = Accelerator(verbose=False)
    acc.prepare(torch.nn.Linear(2, 2))
    seen: list[str] = []

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        assert len(models) == len(weights) == 1
        Path(output_dir, "extra.json").write_text(json.dumps({"n": 1}))

    handle = acc.register_save_state_pre_hook(save_hook)
    load = acc.register_load_state_pre_hook(lambda models, input_dir: seen.append(input_dir))
    acc.save_state(tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert "extra.json" in json.dumps(manifest)  # covered by the checksums like every other file
    acc.load_state(tmp_path / "a")
    assert seen == [str(tmp_path / "a")]
    handle.remove()
    load.remove()
    acc.save_state(tmp_path / "b")
    assert not (tmp_path / "b" / "extra.json").exists()


def test_a_hook_that_takes_weights_out_is_refused_and_nothing_is_saved(tmp_path: Path) -> None:
    acc = Accelerator(verbose=False)
    acc.prepare(torch.nn.Linear(2, 2))
    acc.register_save_state_pre_hook(lambda models, weights, output_dir: weights.pop())
    with pytest.raises(ValueError, match="removed entries from `weights`"):
        acc.save_state(tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_map_location_takes_accelerates_values_and_refuses_others(tmp_path: Path) -> None:
    acc, model = _prepared(tmp_path)
    acc.save_state()
    for where in ("cpu", "on_device"):
        acc.load_state(map_location=where)
    with pytest.raises(TypeError, match="unsupported optimizer map location"):
        acc.load_state(map_location="invalid")
