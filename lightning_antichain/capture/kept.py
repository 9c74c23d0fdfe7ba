"""Plain tensor attributes a graph reads, such as caches that ``forward`` builds on its first call.

``if self.pe is None: self.pe = table(t, device=x.device)`` or ``if self.mask is None or
self.mask.size(0) != t: self.mask = causal_mask(t)``: the graph captured once the cache exists
reads it as a constant, as it reads any tensor attribute that is neither a parameter nor a buffer.
That graph is right for a call only where a plain call would read (or build) the same values, so
the runtime compares the attributes with what the capture found and left on every call, and
captures again from the module's present state where they differ.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..torch_private import pytree
from .specialization import constant_key, input_key

MISSING = object()
"""An attribute the module did not have."""


@dataclass
class KeptCache:
    """The attributes a graph reads as a cache: as the capture found them (``before``) and as one
    call leaves them (``after``, the values the graph reads), by path (``"blocks.0.mask"``)."""

    before: dict[str, Any]
    after: dict[str, Any]

    def holds(self, module: nn.Module) -> bool:
        """Whether a plain call from the module's present state would read the graph's values: every
        attribute is as the capture found or left it (the same object, or equal values)."""
        return all(_same(_get(module, path), self.before[path]) or _same(_get(module, path), value)
                   for path, value in self.after.items())

    def key(self, module: nn.Module) -> Hashable:
        """The attributes' present state as a graph specialises on it: shapes, dtypes, devices."""
        return tuple((path, _describe(_get(module, path))) for path in self.after)

    def apply(self, module: nn.Module) -> None:
        """Leave the attributes as a plain call would: holding the values the graph read."""
        for path, value in self.after.items():
            if _get(module, path) is not value:
                owner, _, name = path.rpartition(".")
                setattr(module.get_submodule(owner), name, value)


def attributes_read(module: nn.Module, graph_module: torch.fx.GraphModule) -> KeptCache | None:
    """The plain tensor attributes of ``module``'s submodules that ``graph_module`` reads as
    constants (the same objects), each as found (``None``: it reads none)."""
    constants = {id(value) for node in graph_module.graph.nodes if node.op == "get_attr"
                 and isinstance(value := _get(graph_module, str(node.target)), torch.Tensor)}
    found = {}
    for owner, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if isinstance(value, torch.Tensor) and id(value) in constants:
                found[f"{owner}.{name}" if owner else name] = value
    return KeptCache(dict(found), found) if found else None


def merged(first: KeptCache | None, then: KeptCache | None) -> KeptCache | None:
    """Both records, ``then``'s where both name an attribute."""
    if first is None or then is None:
        return then if first is None else first
    return KeptCache({**first.before, **then.before}, {**first.after, **then.after})


def kept(module: nn.Module, paths: list[str], build: Callable[[], None]) -> KeptCache:
    """Run ``build`` (which assigns the cache) and record the attributes at ``paths`` around it."""
    before = {path: _get(module, path) for path in paths}
    build()
    return KeptCache(before, {path: _get(module, path) for path in paths})


def _get(module: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    try:
        return getattr(module.get_submodule(owner), name)
    except AttributeError:
        return MISSING


def _same(value: Any, other: Any) -> bool:
    if value is other:
        return True
    ours, spec = pytree.tree_flatten(value)
    theirs, other_spec = pytree.tree_flatten(other)
    return spec == other_spec and all(_same_leaf(a, b) for a, b in zip(ours, theirs))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a is b:
            return True
        if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device) or a.is_meta or b.is_meta:
            return False
        return bool(torch.equal(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a is b or constant_key(a) == constant_key(b)


def _describe(value: Any) -> Hashable:
    if value is MISSING:
        return "missing"
    leaves, spec = pytree.tree_flatten(value)
    return str(spec), input_key(leaves, [None] * len(leaves))
