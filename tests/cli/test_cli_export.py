"""`mixprec export`: a sharded checkpoint (here written by one process) into one safetensors file."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from mixprec.checkpoint.sharded import save_sharded
from mixprec.cli.main import main


def test_export_writes_the_full_weights_and_refuses_a_damaged_folder(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    save_sharded(model, tmp_path / "sharded")
    assert main(["export", str(tmp_path / "sharded"), str(tmp_path / "model.safetensors")]) == 0
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert "model.safetensors" in capsys.readouterr().out

    assert main(["export", str(tmp_path / "sharded"), str(tmp_path / "model.pt")]) == 2
    assert "name a .safetensors file" in capsys.readouterr().err
    # it named a temporary file of its own ("nodir/tmplephizit: no such file or directory")
    assert main(["export", str(tmp_path / "sharded"), str(tmp_path / "nodir" / "x.safetensors")]) == 2
    assert (
        "the folder" in (err := capsys.readouterr().err)
        and "nodir does not exist" in err
        and "tmp" not in err.split("nodir")[-1]
    )
    shard = next((tmp_path / "sharded").glob("*.distcp"))
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    assert main(["export", str(tmp_path / "sharded"), str(tmp_path / "again.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "not a complete sharded checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "again.safetensors").exists()


def test_export_takes_one_model_of_a_checkpoint_holding_several(tmp_path: Path, capsys) -> None:
    # a save_state checkpoint with fsdp_state_dict_type="sharded" and two models: model_0.dcp, model_1.dcp,
    # listed in the checkpoint's own manifest
    from mixprec.checkpoint.manifest import write_manifest

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)]
    for i, model in enumerate(models):
        save_sharded(model, tmp_path / "staged" / f"model_{i}.dcp")
        (tmp_path / "ckpt").mkdir(exist_ok=True)
        (tmp_path / "staged" / f"model_{i}.dcp" / "manifest.json").unlink()  # only the checkpoint's manifest
        (tmp_path / "staged" / f"model_{i}.dcp").rename(tmp_path / "ckpt" / f"model_{i}.dcp")
    write_manifest(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "x.safetensors")]) == 2
    assert "holds 2 models' sharded weights" in (err := capsys.readouterr().err) and "model_0.dcp" in err
    assert main(["export", str(tmp_path / "ckpt" / "model_1.dcp"), str(tmp_path / "one.safetensors")]) == 0
    exported = load_file(tmp_path / "one.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in models[1].state_dict().items())
