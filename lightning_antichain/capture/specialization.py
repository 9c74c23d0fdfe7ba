"""What a captured graph assumed about its inputs, so the runtime can tell when it still holds.

fx graphs are shape-generic. torch.export specialises every dimension but the batch dimension,
which it keeps symbolic over a range (it assumes a size of at least 2); concrete capture specialises
every shape. Constants among the arguments (a ``float`` scale, a flag) are baked into the graph by
both. :func:`input_key` describes a call's inputs by exactly what a graph depends on, so two
micro-batches with the same key can run the same graph, and a new key means capturing again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

BatchRange = tuple[int, int, int | None]
"""The symbolic dim of an input, and the smallest and largest size (``None``: unbounded) it holds for."""


def input_key(values: Sequence[Any], batch_ranges: Sequence[BatchRange | None]) -> Hashable:
    """What a graph captured for ``values`` depends on: shapes, dtypes, devices, constants.

    A tensor whose batch dim is dynamic in the graph (``batch_ranges[i]``) is described without its
    batch size while that size lies in the range.
    """
    key: list[Hashable] = []
    for value, batch in zip(values, batch_ranges):
        if isinstance(value, torch.Tensor):
            shape: list[Any] = list(value.shape)
            if batch is not None:
                dim, lower, upper = batch
                if dim < len(shape) and lower <= shape[dim] and (upper is None or shape[dim] <= upper):
                    shape[dim] = "batch"
            key.append(("tensor", str(value.dtype), value.device.type, tuple(shape)))
        else:
            key.append(constant_key(value))
    return tuple(key)


def constant_key(value: Any) -> Hashable:
    """A non-tensor argument as a graph depends on it: its type and value (``repr`` if unhashable)."""
    try:
        hash(value)
        return "constant", type(value).__name__, value
    except TypeError:
        return "constant", type(value).__name__, repr(value)


@dataclass
class Specialization:
    """The inputs a graph was captured for, and how to capture it again for others.

    ``batch_ranges[i]`` is the batch dim of placeholder i and the range of its sizes the graph holds
    for (``None``: the exact shape only). ``recapture(args, kwargs)`` runs the same frontend on other inputs.
    """

    key: Hashable
    batch_ranges: tuple[BatchRange | None, ...]
    recapture: Callable[[tuple, dict], Any]
    #: what the graph depends on, where it is not :func:`input_key` (fx: only its constant arguments)
    describe: Callable[[Sequence[Any]], Hashable] | None = None

    def key_of(self, values: Sequence[Any]) -> Hashable:
        if self.describe is not None:
            return self.describe(values)
        return input_key(values, self.batch_ranges)

    def holds_for(self, values: Sequence[Any]) -> bool:
        return self.key_of(values) == self.key
