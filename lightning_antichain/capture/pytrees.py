"""Nested values at stage boundaries, flattened into leaves with ``torch.utils._pytree``.

A value crossing a stage boundary can be any nesting of tuples, lists, dicts, named tuples and
dataclasses (``split`` returns a tuple; Hugging Face blocks return ``ModelOutput`` dataclasses).
The runtime ships, detaches and differentiates its tensor leaves one by one and rebuilds the value
on the other side. Dataclasses that pytree does not know yet are registered on first sight, so
their tensor fields are never passed across as one opaque object: pytree's own walk registers
them as it meets them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..torch_private import pytree

_refused: set[type] = set()


def flatten(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of ``value`` and the spec that rebuilds it."""
    return pytree.tree_flatten(value, is_leaf=_register_dataclass)


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it, containers and their types kept."""
    leaves, spec = flatten(value)
    return unflatten([fn(v) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested value (tuples, lists, dicts, named tuples, dataclasses)."""
    return (v for v in flatten(value)[0] if isinstance(v, torch.Tensor))


def _register_dataclass(node: Any) -> bool:
    """Register ``node``'s type with pytree if it is a dataclass pytree does not know yet, as
    pytree meets it on its walk (which asks this of every node first); never a leaf by itself."""
    kind = type(node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type) and kind not in pytree.SUPPORTED_NODES and (
            kind not in _refused):
        try:
            pytree.register_dataclass(kind)
        except (TypeError, ValueError):  # e.g. fields with init=False: leave it a leaf
            _refused.add(kind)
    return False
