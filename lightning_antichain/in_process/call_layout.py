"""How calls of one shape are split and joined, decided on the first such call.

torch pipelining fixes its chunk specs when a schedule is built; torchgpipe's ``forward`` is
check, scatter, run, gather. A ``Pipeline`` learns what it needs from the first call of each input
shape instead (the capture decides where samples are, the outputs where to join), and keeps it here
so that every later call of that shape reads split, run, join: no batch-dim search over the
outputs, no specialisation test per micro-batch, no probing passes.

A layout is only reused for calls it provably holds for: the key is everything the decisions
depended on (every input leaf's shape, dtype and device, every constant, the nesting, the chunk
count), and the join is kept per output shapes, seen again on each call before it is used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from ..batches.model_loss import WeightedSum
from ..capture.pytrees import flatten
from ..capture.specialization import constant_key
from ..plans.schedule import Schedule
from ..stages.split import StageModule

OutputDims = list[int | WeightedSum | None]
"""Per output leaf, the dim it joins on, the weights of a loss, or ``None`` (not joined)."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def call_key(values: Sequence[Any], chunks: int) -> Hashable:
    """What a call's split depends on: its nesting, each tensor leaf's dtype, device and shape, each
    other leaf's value, and the chunk count."""
    leaves, spec = flatten(list(values))
    return chunks, spec, tuple(("tensor", v.dtype, v.device, tuple(v.shape)) if isinstance(v, torch.Tensor)
                               else constant_key(v) for v in leaves)


def shapes_key(micro_leaves: Sequence[Sequence[Any]]) -> Hashable:
    """The micro-batches' output leaves as a join depends on them: each tensor's shape and dtype."""
    return tuple(tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in leaves)
                 for leaves in micro_leaves)


class Recent(Generic[K, V]):
    """The ``size`` entries used last, by key: calls whose shapes vary (the last, smaller batch of an
    epoch; a text batch padded to its longest sample) keep what they decided without growing
    without bound."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, make: Callable[[], V]) -> V:
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = make()
        self._entries[key] = value
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class CallLayout:
    """One call shape's split and join: each micro-batch's size and stages (those of its
    specialisation), the schedule over them, whether any stage draws random numbers (then the
    step seeds them), and the join of each output leaf by the outputs' shapes."""

    sizes: list[int | None]
    micro_stages: list[list[StageModule]]
    schedule: Schedule
    draws: bool
    joins: Recent[Hashable, OutputDims] = field(default_factory=lambda: Recent(4))

    def output_dims(self, micro_leaves: Sequence[Sequence[Any]], decide: Callable[[], OutputDims]) -> OutputDims:
        """The join of these outputs: decided by ``decide()`` the first time outputs of their shapes
        are seen."""
        return self.joins.get(shapes_key(micro_leaves), decide)
