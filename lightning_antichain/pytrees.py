"""Nested values at stage boundaries, flattened into leaves with ``torch.utils._pytree``.

A value crossing a stage boundary can be any nesting of tuples, lists, dicts, named tuples and
dataclasses (``split`` returns a tuple; Hugging Face blocks return ``ModelOutput`` dataclasses).
The runtime ships, detaches and differentiates its tensor leaves one by one and rebuilds the value
on the other side. Dataclasses that pytree does not know yet are registered on first sight, so
their tensor fields are never passed across as one opaque object.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.utils._pytree as pytree

_refused: set[type] = set()


def flatten(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of ``value`` and the spec that rebuilds it."""
    _register_dataclasses(value)
    return pytree.tree_flatten(value)


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)


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
