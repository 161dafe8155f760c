"""HF's ``Seq2SeqTrainer`` / ``Seq2SeqTrainingArguments`` (run_summarization.py, run_translation.py): the
Trainer, plus evaluation and prediction by generation.

With ``predict_with_generate=True``, ``evaluate()`` and ``predict()`` hand ``compute_metrics`` the tokens
``model.generate`` produced (batches of different lengths padded with -100, which HF's scripts map back to the
pad token before decoding), and the loss from the labels as usual. Generation runs under the training
precision, like every forward of the prepared model. ``max_length`` / ``num_beams`` (and any other
``generate`` keyword) given to ``evaluate``/``predict`` win over ``generation_max_length`` /
``generation_num_beams`` (a ``None`` given, as scripts pass an unset option, does not; nor is ``max_length``
added to a call that gives ``max_new_tokens``), which win over the model's generation config. A
``generation_config`` named by a folder or file is loaded when the Seq2SeqTrainer is built (as HF's
``load_generation_config``), so one set after the arguments were made counts too.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.trainer.args import TrainingArguments
from mixprec.trainer.configs import fail
from mixprec.trainer.trainer import Trainer


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments):
    """TrainingArguments with HF's generation fields."""

    predict_with_generate: bool = False
    """Evaluate and predict on generated tokens (for ROUGE, BLEU...) instead of the logits."""
    generation_max_length: int | None = None
    """``max_length`` for generation during evaluation and prediction (None: the model's)."""
    generation_num_beams: int | None = None
    """``num_beams`` for generation during evaluation and prediction (None: the model's)."""
    generation_config: str | Path | None = None
    """A ``transformers.GenerationConfig``, or a folder or file it loads from (``from_pretrained``)."""
    sortish_sampler: bool = False
    """HF's length-sorted sampler: refused (mixprec's order is seeded and exactly resumable)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sortish_sampler:
            fail("sortish_sampler", True, "is not implemented; leave it False (the order is seeded shuffling)")
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                fail(name, value, "must be a positive integer or None")
        config = self.generation_config
        if not (config is None or isinstance(config, (str, os.PathLike)) or hasattr(config, "to_diff_dict")):
            fail("generation_config", config, "must be a transformers.GenerationConfig, a folder or a file")

    def to_dict(self) -> dict[str, Any]:
        """The Trainer's, with the generation config as its dict or its path as a string (HF's JSON)."""
        values = super().to_dict()
        config = values["generation_config"]
        if config is not None:
            values["generation_config"] = str(config) if isinstance(config, (str, os.PathLike)) else config.to_dict()
        return values


class Seq2SeqTrainer(Trainer):
    """The Trainer with HF's generation-based evaluation (how: :mod:`mixprec.trainer.seq2seq`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = getattr(self.args, "generation_config", None)
        if config is not None:
            self.accelerator.unwrap_model(self.model).generation_config = self.load_generation_config(config)
        self._gen_kwargs: dict[str, Any] = {}

    @staticmethod
    def load_generation_config(config: Any) -> Any:
        """A copy of a ``GenerationConfig``, or one loaded from a folder or from a file (HF's name and rule)."""
        from transformers import GenerationConfig

        if isinstance(config, GenerationConfig):
            return copy.deepcopy(config)
        path = Path(config)
        if path.is_file():
            return GenerationConfig.from_pretrained(path.parent, path.name)
        return GenerationConfig.from_pretrained(config)

    def _generation_kwargs(self, given: dict[str, Any]) -> dict[str, Any]:
        """The call's ``generate`` keywords over the arguments' (HF's rule: a None given takes the argument's,
        and ``max_new_tokens`` keeps ``generation_max_length`` out)."""
        kwargs = {k: v for k, v in given.items() if v is not None}
        defaults = {"num_beams": getattr(self.args, "generation_num_beams", None)}
        if "max_new_tokens" not in kwargs:
            defaults["max_length"] = getattr(self.args, "generation_max_length", None)
        return {**{k: v for k, v in defaults.items() if v is not None}, **kwargs}

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval", **gen_kwargs: Any
    ) -> dict:
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset: Any, ignore_keys: Any = None, metric_key_prefix: str = "test", **gen_kwargs: Any):
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None, **gen_kwargs
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """``(loss, generated tokens, labels)`` with ``predict_with_generate``; else the Trainer's step."""
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        kwargs = {**self._gen_kwargs, **gen_kwargs} if gen_kwargs else dict(self._gen_kwargs)
        generation_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        labels = inputs.get("labels")
        decoder = generation_inputs.get("decoder_input_ids")
        if labels is not None and decoder is not None and decoder.shape == labels.shape:
            # made from the labels by the collator: generation must start from scratch, not continue them
            generation_inputs.pop("decoder_input_ids")
            generation_inputs.pop("decoder_attention_mask", None)
        tokens = model.generate(**generation_inputs, **kwargs)  # the prepared model: its forwards run autocast
        loss = None
        if labels is not None:
            loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys)  # the Trainer's loss
        return loss, tokens, labels
