"""Nested containers, walked one way: torch's pytree, with the container types it does not know registered once.

``torch.utils._pytree`` knows tuples, lists, dicts (OrderedDict, defaultdict), namedtuples and deques, and
transformers registers its own ModelOutput classes. A model, a collate function or a callback may hand over
others: a Mapping that is not a dict (a ``UserDict``, a ModelOutput-like class of a library that registers
nothing) or a dataclass of tensors. Unknown to the pytree, each is one opaque leaf: its tensors are not cast
back to fp32, moved to the device, gathered or logged. So every walk over user data in mixprec goes through the
functions here, which register such a type as a pytree node the first time a tree holding it passes (once per
type: from then on torch's own users of the pytree see it too, DDP's flattening of a module's output among them):

- a Mapping with ``to_tuple`` (a ModelOutput's shape): its keys and values, rebuilt as ``cls(**fields)``, as
  transformers registers its own;
- any other Mapping: its items, rebuilt as ``cls(dict)``, or a plain dict when the class cannot be built
  from one;
- a dataclass instance: its ``init`` fields, rebuilt as ``cls(**fields)`` (as ``dataclasses.replace``).

Everything else (tensors, numbers, strings, None, other objects) is a leaf. A cyclic structure recurses without
end, as in torch's pytree. This module imports nothing from mixprec (a leaf below every layer).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils import _pytree

TreeSpec = _pytree.TreeSpec
tree_unflatten = _pytree.tree_unflatten

_classified: set[type] = set()  # types already looked at (registered here, known to torch, or leaves)
_lock = threading.Lock()


def tree_map(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``fn`` applied to every leaf of ``tree``, in a tree of the same container types. ``is_leaf`` stops the
    walk at the nodes it accepts (``fn`` gets them whole)."""
    return _pytree.tree_map(fn, tree, is_leaf=_leaf_test(is_leaf))


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree``, depth first, in the containers' order."""
    return _pytree.tree_leaves(tree, is_leaf=_leaf_test(is_leaf))


def tree_flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeSpec]:
    """The leaves and the structure, for :func:`tree_unflatten` to rebuild."""
    return _pytree.tree_flatten(tree, is_leaf=_leaf_test(is_leaf))


def strict_json(tree: Any) -> Any:
    """``tree`` for strict JSON (``json.dumps(..., allow_nan=False)``): 0-dim tensors and numpy scalars as Python
    numbers, inf and NaN as None (JSON has no literal for them; Python writes ``NaN``, which strict readers
    refuse)."""

    def leaf(x: Any) -> Any:
        if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
            x = x.item()
        return None if isinstance(x, float) and not math.isfinite(x) else x

    return tree_map(leaf, tree)


def is_container(obj: Any) -> bool:
    """Whether the walk goes into ``obj`` (a type torch's pytree knows or one registered here)."""
    _register_if_container(obj)
    return not _pytree.tree_is_leaf(obj)


def _leaf_test(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    # torch's walk asks is_leaf(node) before it looks the node's type up, so registering the type here, on
    # the way, makes the very node that met it a container
    if is_leaf is None:
        return _register_if_container
    return lambda node: is_leaf(node) or _register_if_container(node)


def _register_if_container(node: Any) -> bool:
    """Register ``type(node)`` if it is a container torch's pytree does not know. Always False (a predicate
    for ``is_leaf`` that never stops the walk)."""
    cls = type(node)
    if cls in _classified:
        return False
    with _lock:
        if cls not in _classified and cls not in _pytree.SUPPORTED_NODES and not _pytree.is_namedtuple_class(cls):
            _register(cls)
        _classified.add(cls)
    return False


def _register(cls: type) -> None:
    if issubclass(cls, Mapping) and hasattr(cls, "to_tuple"):
        _pytree.register_pytree_node(cls, _flatten_mapping, _rebuild_with_fields(cls))
    elif issubclass(cls, Mapping):
        _pytree.register_pytree_node(cls, _flatten_mapping, _rebuild_mapping(cls))
    elif dataclasses.is_dataclass(cls):
        _pytree.register_pytree_node(cls, _flatten_dataclass, _rebuild_with_fields(cls))


def _flatten_mapping(node: Mapping) -> tuple[list[Any], list[Any]]:
    keys = list(node.keys())
    return [node[k] for k in keys], keys


def _flatten_dataclass(node: Any) -> tuple[list[Any], list[str]]:
    names = [f.name for f in dataclasses.fields(node) if f.init]
    return [getattr(node, name) for name in names], names


def _rebuild_with_fields(cls: type) -> Callable[[list[Any], list[Any]], Any]:
    def rebuild(values: list[Any], keys: list[Any]) -> Any:
        return cls(**dict(zip(keys, values)))

    return rebuild


def _rebuild_mapping(cls: type) -> Callable[[list[Any], list[Any]], Any]:
    def rebuild(values: list[Any], keys: list[Any]) -> Any:
        items = dict(zip(keys, values))
        try:
            return cls(items)
        except TypeError:  # a Mapping that cannot be built from a dict: its items, as a dict
            return items

    return rebuild
