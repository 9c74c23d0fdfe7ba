"""The capture a profile was made from, carried along to its plans, so a Pipeline reuses it.

``la.profile`` captures the module; ``la.partition`` makes a plan from the profile; ``la.Pipeline``
would capture again. It need not: the profile's graph is kept beside the cost graph and the plans
made from it (weakly: it lives as long as they do, and is never saved), with the state of the
module it was captured from. A Pipeline given such a plan runs that graph if the module is the
same object in the same state (dtypes, devices, shapes, modes); otherwise it captures again.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

from torch import nn

from .isolation import training_flags
from .opgraph import OpGraph

_carried: dict[int, tuple[OpGraph, Hashable]] = {}
"""By ``id`` of the owner (plans compare by value, so they cannot be weak keys); an entry goes when
its owner does."""


def carry(owner: Any, graph: OpGraph | None) -> None:
    """Keep ``graph`` with ``owner`` (a cost graph, a plan), if it can run."""
    if graph is not None and graph.graph_module is not None:
        _keep(owner, (graph, _state(graph.module)))


def pass_on(source: Any, target: Any) -> None:
    """What ``source`` carries, carried by ``target`` too (a plan made from a cost graph)."""
    found = _carried.get(id(source))
    if found is not None:
        _keep(target, found)


def _keep(owner: Any, entry: tuple[OpGraph, Hashable]) -> None:
    if id(owner) not in _carried:
        weakref.finalize(owner, _carried.pop, id(owner), None)
    _carried[id(owner)] = entry


def carried(owner: Any, module: nn.Module) -> OpGraph | None:
    """The graph ``owner`` carries, if it was captured from ``module`` as it is now."""
    found = _carried.get(id(owner))
    if found is None:
        return None
    graph, state = found
    return graph if graph.module is module and _state(module) == state else None


def _state(module: nn.Module) -> Hashable:
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return training_flags(module), tuple((name, t.dtype, t.device, tuple(t.shape)) for name, t in tensors)
