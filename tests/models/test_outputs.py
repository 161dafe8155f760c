"""extract_loss reads the loss the way the Trainer does, and says what it found when it cannot."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mixprec.models.outputs import extract_loss


@dataclass
class _Out:
    loss: torch.Tensor | None
    logits: torch.Tensor | None = None


def test_accepted_output_shapes() -> None:
    loss = torch.tensor(2.5)
    assert extract_loss(loss) is loss
    assert extract_loss(_Out(loss)) is loss
    assert extract_loss({"loss": loss, "logits": torch.ones(3)}) is loss
    assert extract_loss((loss, torch.ones(3))) is loss
    one = torch.ones(1)
    assert extract_loss([one]) is one  # a single-element loss of shape [1] is accepted as is


def test_hf_model_output_is_read_by_key() -> None:
    transformers = pytest.importorskip("transformers")
    loss = torch.tensor(1.0)
    out = transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=torch.ones(2))
    assert extract_loss(out) is loss


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ({"logits": torch.ones(2)}, "without a 'loss' key"),
        (_Out(None), "loss=None"),
        (torch.ones(3), "single floating-point value"),
        (torch.tensor(3), "single floating-point value"),
        ("text", "cannot find a loss"),
        ((), "cannot find a loss"),
        ((1.0,), "must be a tensor"),
    ],
)
def test_refusals_say_what_was_found(outputs, match) -> None:
    with pytest.raises(ValueError, match=match):
        extract_loss(outputs)
