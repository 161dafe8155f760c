"""mixprec.tree: the one walk over nested user data, with the containers torch's pytree does not know (other
Mappings, ModelOutput-like classes, dataclasses) registered once; and the walks built on it (a model's outputs
cast back to fp32, a batch sent to a device) keeping each container's type."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils import _pytree

from mixprec import tree
from mixprec.loaders.data import send_to_device
from mixprec.precision.registry import make_precision


class Batch(collections.UserDict):
    """A Mapping that is not a dict (as HF's BatchEncoding is, minus its .to)."""


class FixedKeys(Mapping):
    """A read-only Mapping whose constructor takes no dict: rebuilt as a plain dict."""

    def __init__(self, a: Any, b: Any) -> None:
        self._d = {"a": a, "b": b}

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return 2


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    hidden: list[torch.Tensor]
    note: str = "kept"


@dataclasses.dataclass
class ModelOutputLike(collections.OrderedDict):
    """transformers' ModelOutput shape (a dataclass and an OrderedDict, with to_tuple), but not registered."""

    logits: torch.Tensor | None = None
    past: tuple | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def to_tuple(self) -> tuple:
        return tuple(self.values())


class MovesItself:
    """An object with its own ``.to`` (HF's BatchEncoding): sent whole, never walked into."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any) -> MovesItself:
        return MovesItself(self.t.to(device))


def half(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bfloat16)


def test_unknown_containers_are_walked_and_keep_their_types():
    data = {
        "batch": Batch(x=half(2), y=[half(1)]),
        "fixed": FixedKeys(half(1), 3),
        "out": Output(loss=half(()), hidden=[half(2), half(3)]),
        "hf": ModelOutputLike(logits=half(4)),
    }
    assert len([t for t in tree.tree_leaves(data) if isinstance(t, torch.Tensor)]) == 7
    doubled = tree.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, data)
    assert type(doubled["batch"]) is Batch and doubled["batch"]["y"][0].item() == 2
    assert type(doubled["fixed"]) is dict and doubled["fixed"]["b"] == 3  # cannot be built from a dict
    out = doubled["out"]
    assert type(out) is Output and out.note == "kept" and out.hidden[1].shape == (3,) and out.loss.item() == 2
    hf = doubled["hf"]
    assert type(hf) is ModelOutputLike and list(hf.keys()) == ["logits"] and hf.to_tuple()[0].sum().item() == 8


def test_a_type_is_registered_once_and_torchs_own_walk_then_sees_inside():
    @dataclasses.dataclass
    class Fresh:
        a: torch.Tensor

    value = Fresh(torch.zeros(2))
    assert _pytree.tree_leaves(value) == [value]  # torch alone: one opaque leaf
    tree.tree_leaves(value)
    node = _pytree.SUPPORTED_NODES[Fresh]
    tree.tree_leaves([value, Fresh(torch.ones(1))])  # no second registration (torch would refuse one)
    assert _pytree.SUPPORTED_NODES[Fresh] is node
    assert len(_pytree.tree_leaves(value)) == 1 and _pytree.tree_leaves(value)[0] is value.a  # DDP's view


def test_is_container_tells_a_generator_from_a_registered_mapping():
    assert tree.is_container(Batch(a=1)) and tree.is_container([1])
    assert not tree.is_container(x for x in range(2)) and not tree.is_container(torch.zeros(1))


def test_convert_output_casts_inside_every_container_and_keeps_types():
    precision = make_precision("bf16", torch.device("cpu"))
    outputs = (Output(loss=half(()), hidden=[half(2)]), Batch(x=half(1)), ModelOutputLike(half(2)))
    out = precision.convert_output(outputs)
    leaves = [t for t in tree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert len(leaves) == 4 and {t.dtype for t in leaves} == {torch.float32}
    assert [type(x) for x in out] == [Output, Batch, ModelOutputLike]
    ids = precision.convert_output({"ids": torch.arange(3)})["ids"]
    assert ids.dtype == torch.int64  # integer tensors pass through


def test_send_to_device_moves_tensors_in_dataclasses_and_sends_objects_with_to_whole():
    batch = {"out": Output(loss=torch.zeros(()), hidden=[torch.ones(2)]), "enc": MovesItself(torch.ones(1))}
    moved = send_to_device(batch, "meta")
    assert moved["out"].loss.is_meta and moved["out"].hidden[0].is_meta and type(moved["out"]) is Output
    assert type(moved["enc"]) is MovesItself and moved["enc"].t.is_meta


def test_strict_json_writes_what_strict_readers_accept():
    import json
    import math

    import numpy as np

    from mixprec.tree import strict_json

    data = {"loss": float("nan"), "scale": torch.tensor(2.0), "best": np.float32(1.5), "seen": [math.inf, 1.0]}
    text = json.dumps(strict_json(data), allow_nan=False)  # Python's default writes NaN, which is not JSON
    assert json.loads(text) == {"loss": None, "scale": 2.0, "best": 1.5, "seen": [None, 1.0]}
