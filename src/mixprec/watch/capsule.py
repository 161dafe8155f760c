"""A bad step in a folder: what it takes to run that step again, away from the run (``mixprec replay``).

When a step's gradients are non-finite (any precision: the scaler or the non-finite guard skipped it) or its
loss spikes past the watch's threshold, the watch writes ``<run folder>/capsules/step-<N>/``:

- ``batch.safetensors``: every micro-batch of the step (keyword tensors, ``<i>.<name>``);
- ``rng.safetensors``: the CPU (and CUDA) generator state the step's first forward started from;
- ``model.safetensors``: the weights the step started from (a skipped step left them as they were; a spike is
  caught in the optimizer's pre-step hook, before they change);
- ``capsule.json``: the step, why, the run's precision and loss scale, the modules in fp32 fallback, how to
  rebuild the model (the built-in GPT's or a transformers model's config), the optimizer and the newest
  checkpoint folder of the run (the state reference), and the SHA-256 of each file and of the whole.

Only safetensors and JSON: nothing read back can run code (no pickle). Loading checks every hash first, so a
damaged or edited capsule is refused by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.checkpoint.atomic import atomic_dir
from mixprec.checkpoint.folders import trainer_folders
from mixprec.checkpoint.manifest import file_digest
from mixprec.checkpoint.safe_files import CheckpointError, load_json, load_tensors, save_json, save_tensors

FORMAT = "mixprec-capsule/1"
META = "capsule.json"
FILES = ("batch.safetensors", "rng.safetensors", "model.safetensors")
_JSON_SCALARS = (bool, int, float, str, type(None))


@dataclass
class Capsule:
    """A capsule read back (see the module docstring); tensors on the CPU."""

    folder: Path
    meta: dict[str, Any]
    batches: list[dict[str, Any]]
    rng: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def precision(self) -> str:
        return str(self.meta["precision"])

    @classmethod
    def load(cls, folder: str | Path) -> Capsule:
        """Read and verify a capsule folder (or its capsule.json). Raises CheckpointError naming what is wrong."""
        folder = Path(folder)
        if folder.name == META:
            folder = folder.parent
        if not (folder / META).is_file():
            raise FileNotFoundError(f"{folder}: no {META} here; pass a capsule folder (<run>/capsules/step-N)")
        meta = load_json(folder / META)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{folder / META}: not a mixprec capsule (format {meta.get('format')!r})")
        for name, digest in meta["sha256"].items():
            if not (folder / name).is_file() or file_digest(folder / name) != digest:
                raise CheckpointError(f"{folder / name}: missing or changed since the capsule was written (hash)")
        if _whole_hash(meta) != meta.get("hash"):
            raise CheckpointError(f"{folder / META}: edited since the capsule was written (hash)")
        flat = load_tensors(folder / "batch.safetensors")
        batches: list[dict[str, Any]] = [dict(extra) for extra in meta["batch_values"]]
        for key, t in flat.items():
            index, _, name = key.partition(".")
            batches[int(index)][name] = t
        return cls(
            folder, meta, batches, load_tensors(folder / "rng.safetensors"), load_tensors(folder / "model.safetensors")
        )

    def restore_rng(self, device: torch.device) -> None:
        """Set the generators to where the step's first forward started."""
        torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng and device.type == "cuda":
            torch.cuda.set_rng_state(self.rng["cuda"], device)


def write_capsule(
    run_folder: str | Path,
    *,
    step: int,
    reason: str,
    model: nn.Module,
    batches: list[dict[str, Any]],
    rng: tuple[torch.Tensor, torch.Tensor | None],
    precision: str,
    loss: float | None,
    loss_scale: float,
    fallbacks: list[str],
    optimizer: str | None,
) -> Path:
    """Write the capsule of ``step`` into ``run_folder/capsules/step-<N>`` (atomically) and return its path.
    Copies the weights and the batch to the host: several syncs, on a bad step only."""
    target = Path(run_folder) / "capsules" / f"step-{step:08d}"
    flat: dict[str, torch.Tensor] = {}
    values: list[dict[str, Any]] = []
    for i, batch in enumerate(batches):
        kept: dict[str, Any] = {}
        for name, v in batch.items():
            if isinstance(v, torch.Tensor):
                flat[f"{i}.{name}"] = v.detach()
            elif isinstance(v, _JSON_SCALARS):
                kept[name] = v
            else:
                raise ValueError(f"batch entry {name!r} is a {type(v).__name__}: a capsule holds tensors and scalars")
        values.append(kept)
    rng_tensors = {"cpu": rng[0]} | ({"cuda": rng[1]} if rng[1] is not None else {})
    meta: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "reason": reason,
        "precision": precision,
        "loss": loss,
        "loss_scale": loss_scale,
        "fp32_fallback": list(fallbacks),
        "model": model_spec(model),
        "batch_values": values,
        "state_reference": {"optimizer": optimizer, "latest_checkpoint": _latest_checkpoint(Path(run_folder))},
    }
    with atomic_dir(target) as tmp:
        save_tensors(flat, tmp / "batch.safetensors")
        save_tensors(rng_tensors, tmp / "rng.safetensors")
        save_tensors(model.state_dict(), tmp / "model.safetensors")
        meta["sha256"] = {name: file_digest(tmp / name) for name in FILES}
        meta["hash"] = _whole_hash(meta)
        save_json(meta, tmp / META)
    return target


def _whole_hash(meta: dict[str, Any]) -> str:
    """SHA-256 over everything in capsule.json but the hash itself (the files enter through their hashes)."""
    body = {k: v for k, v in meta.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def model_spec(model: nn.Module) -> dict[str, Any]:
    """How ``mixprec replay`` rebuilds the model: the built-in GPT's config, a transformers model's class and
    config, or only the class name (then the replay needs the model passed in from Python)."""
    from mixprec.models import GPT

    if isinstance(model, GPT):
        return {"kind": "mixprec.gpt", "config": dataclasses.asdict(model.config)}
    config = getattr(model, "config", None)
    if type(model).__module__.startswith("transformers.") and hasattr(config, "to_dict"):
        return {"kind": "transformers", "class": type(model).__name__, "config": config.to_dict()}
    return {"kind": "python", "class": f"{type(model).__module__}.{type(model).__qualname__}"}


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model a capsule's spec describes, freshly initialised (its weights come from the capsule)."""
    kind = spec.get("kind")
    if kind == "mixprec.gpt":
        from mixprec.models import GPT, GPTConfig

        return GPT(GPTConfig(**spec["config"]))
    if kind == "transformers":
        import transformers

        config = dict(spec["config"])
        config_obj = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        return getattr(transformers, spec["class"])(config_obj)
    raise ValueError(
        f"the capsule's model is a {spec.get('class', '?')}, which the command line cannot rebuild; replay it from "
        "Python: mixprec.watch.replay(CAPSULE, model=YourModel(...))"
    )


def _latest_checkpoint(run_folder: Path) -> str | None:
    """The newest complete ``checkpoint-N`` folder of the run, if any (where to resume to reproduce): counted as
    the Trainer counts them (a folder without the Trainer's files is not one)."""
    latest = trainer_folders(run_folder).latest()
    return None if latest is None else str(latest.relative_to(run_folder))
