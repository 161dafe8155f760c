"""The model's weights out of a run and back into it: ``Trainer.save_model``'s folder, and the best
checkpoint's weights loaded at the end (``load_best_model_at_end``).

Both go through the Accelerator's distributed strategy, as its checkpoints do: under FSDP2 a process holds
only its shard of each parameter, so ``model.state_dict()`` there is a dict of DTensor shards; the strategy
gathers the full weights onto the main process to save, and scatters full weights back to load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.checkpoint import save_json, save_tensors
from mixprec.checkpoint.model_part import saved_keys

if TYPE_CHECKING:
    import torch

    from mixprec.accelerator.accelerator import Accelerator
    from mixprec.trainer.args import TrainingArguments
    from mixprec.trainer.state import TrainerState

logger = logging.getLogger("mixprec.trainer")

WEIGHTS_NAME = "model.safetensors"


def model_config_file(model: Any) -> dict[str, Any]:
    """``{"config": ...}`` (written as config.json) for a model with an HF-style config, so
    ``from_pretrained("checkpoint-N")`` finds one next to model.safetensors; {} otherwise, and for a peft
    model: its checkpoint holds the adapters only (:func:`adapter_files`), and the base's config.json beside
    them would make ``from_pretrained`` build a randomly initialised model from it, silently."""
    if saved_keys(model) is not None:
        return {}
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    return {"config": json.loads(config.to_json_string())}


def adapter_files(model: Any) -> Callable[[list[Any], list[Any], str], None] | None:
    """For a peft model, the checkpoint save hook that writes peft's files into the unfinished folder (so
    they are in its manifest), as HF's Trainer's checkpoints hold them: adapter_config.json,
    adapter_model.safetensors (and README.md), which ``PeftModel.from_pretrained(base, "checkpoint-N")``
    loads. They are written by peft's ``save_pretrained`` from the state the checkpoint saves (the trainable
    parameters, gathered under FSDP2), so they cost the adapters' size again; mixprec's resume reads
    model.safetensors. None for any other model. A sharded FSDP2 state (``model_0.dcp``) has no gathered
    state to write them from: ``mixprec export`` makes one file of it."""
    if saved_keys(model) is None:
        return None

    def write(models: list[Any], weights: list[Any], folder: str) -> None:
        index = next((i for i, m in enumerate(models) if m is model), None)
        if index is not None and index < len(weights):
            model.save_pretrained(folder, state_dict=weights[index], safe_serialization=True)

    return write


def save_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    out: Path,
    args: TrainingArguments,
    processing_class: Any = None,
) -> Path:
    """Write the (unwrapped) model's full weights as safetensors (HF models via ``save_pretrained``), with
    the tokenizer/processor when one was given and the run's arguments. Collective: every process calls it
    (FSDP2 gathers the shards); the main process writes."""
    model = accelerator.unwrap_model(model)
    state = accelerator.strategy.model_state_dict(model)  # the full weights on the main process, else None
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(str(out), state_dict=state)
        else:
            save_tensors(state, out / WEIGHTS_NAME)
        if hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(str(out))
        save_json(args.to_dict(), out / "training_args.json")
    accelerator.wait_for_everyone()
    return out


def load_best_model(
    accelerator: Accelerator, model: torch.nn.Module, args: TrainingArguments, state: TrainerState
) -> None:
    """``load_best_model_at_end``: the best checkpoint's full weights into the model (under FSDP2 the main
    process reads the file and each process keeps its shard). Collective."""
    best = state.best_model_checkpoint
    if best is None or not Path(best).is_dir():
        return
    accelerator.checkpoints.load_weights(best, accelerator.unwrap_model(model))
    logger.info("loaded the best model (%s = %s) from %s", args.evaluation.metric_key(), state.best_metric, best)
