"""Nested values at stage boundaries, flattened into leaves with ``torch.utils._pytree``.

A value crossing a stage boundary can be any nesting of tuples, lists, dicts, named tuples and
dataclasses (``split`` returns a tuple; Hugging Face blocks return ``ModelOutput`` dataclasses).
The runtime ships, detaches and differentiates its tensor leaves one by one and rebuilds the value
on the other side. Dataclasses that pytree does not know yet are registered on first sight, so
their tensor fields are never passed across as one opaque object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

_refused: set[type] = set()


def flatten(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of ``value`` and the spec that rebuilds it."""
    _register_dataclasses(value)
    return pytree.tree_flatten(value)


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it, containers and their types kept."""
    leaves, spec = flatten(value)
    return unflatten([fn(v) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested value (tuples, lists, dicts, named tuples, dataclasses)."""
    return (v for v in flatten(value)[0] if isinstance(v, torch.Tensor))


def _register_dataclasses(value: Any) -> None:
    kind = type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if kind not in pytree.SUPPORTED_NODES and kind not in _refused:
            try:
                pytree.register_dataclass(kind)
            except (TypeError, ValueError):  # e.g. fields with init=False: leave it a leaf
                _refused.add(kind)
        for f in dataclasses.fields(value):
            _register_dataclasses(getattr(value, f.name, None))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _register_dataclasses(item)
    elif isinstance(value, dict):
        for item in value.values():
            _register_dataclasses(item)
