"""Attributes that ``forward`` assigns (``self.src_mask = ...``), kept as they are without the pipeline.

A captured graph only computes tensors; the assignment itself is Python and would be lost. So
capture runs ``forward`` through a wrapper that also returns every value it assigned to an attribute
of any submodule: the tensors among them become outputs of the graph, the other values (ints,
``None``) are kept as they were assigned. After each pipelined call the runtime assigns them again,
joined across micro-batches the way a whole-batch call would have produced them, and refuses values
it cannot join rather than store a wrong one.

Whether replaying is right at all depends on what the next call would do. The chain captures a
second time from the state the first call left (:func:`settle` in :mod:`lightning_antichain.capture`)
and compares; see ``docs/capture.md``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..torch_private import pytree
from .batch_axis import batch_dim_candidates
from .isolation import plain_attributes
from .signature import original_forward


class AssignmentError(RuntimeError):
    """An attribute assigned in ``forward`` cannot be given the value a whole-batch call would give."""


@dataclass(frozen=True)
class Output:
    """A leaf of an assigned value computed by the graph: the output node that holds it, whether it
    changes with the batch, and whether it needed gradients when captured."""

    node: str
    per_sample: bool = False
    requires_grad: bool = False


@dataclass(frozen=True)
class Assignment:
    """``<owner>.<name> = value`` made by ``forward``; ``leaves`` are :class:`Output` or constants."""

    owner: str
    name: str
    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]

    @property
    def path(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else self.name

    @property
    def constants(self) -> tuple[Any, ...]:
        return tuple(v for v in self.leaves if not isinstance(v, Output))


@dataclass
class Recording:
    """What the wrapped ``forward`` assigned: ``(owner, name, value)`` in order, and which of them
    gave a tensor to a buffer registered as ``None``."""

    changes: list[tuple[str, str, Any]] = field(default_factory=list)
    filled_buffers: list[str] = field(default_factory=list)


@contextlib.contextmanager
def recording_assignments(module: nn.Module, buffers: bool) -> Iterator[Recording]:
    """Inside, ``module(...)`` returns ``(output, tensor_leaves)``: the tensors ``forward`` assigned.

    ``buffers``: also record registered buffers replaced by assignment (``self.mask = ...`` on a
    buffer registered as ``None`` gives the module a new ``state_dict()`` entry).
    """
    recording = Recording()
    bound = original_forward(module)

    @functools.wraps(bound)
    def forward(*args: Any, **kwargs: Any) -> Any:
        before = _attributes(module, buffers)
        output = bound(*args, **kwargs)
        recording.changes = _changed(module, before, buffers)
        owners = {owner: module.get_submodule(owner) for owner, _, _ in recording.changes}
        recording.filled_buffers = [
            f"{owner}.{name}" if owner else name for owner, name, _ in recording.changes
            if name in owners[owner]._buffers and before[owners[owner]].get(name) is None
        ]
        tensors = [leaf for *_, value in recording.changes for leaf in pytree.tree_leaves(value)
                   if isinstance(leaf, torch.Tensor)]
        return output, tuple(tensors)

    module.forward = forward
    try:
        yield recording
    finally:
        vars(module).pop("forward", None)


def symbolic_values(recording: Recording) -> list[str]:
    """Paths of assigned values that are neither tensors nor plain constants (SymInts, fx Proxies)."""
    found = []
    for owner, name, value in recording.changes:
        if any(_symbolic(leaf) for leaf in pytree.tree_leaves(value)):
            found.append(f"{owner}.{name}" if owner else name)
    return found


def _symbolic(leaf: Any) -> bool:
    return isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool, fx.Proxy))


def assignments_of(recording: Recording, outputs: Sequence[Any], inputs: set[str]) -> tuple[Assignment, ...]:
    """The recorded assignments, their tensor leaves mapped onto the graph's extra ``outputs``."""
    it = iter(outputs)
    found = []
    for owner, name, value in recording.changes:
        leaves, spec = pytree.tree_flatten(value)
        mapped = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                node = next(it)
                mapped.append(Output(node.name, per_sample(node, inputs), leaf.requires_grad)
                              if isinstance(node, fx.Node) else node)
            else:
                mapped.append(leaf)
        found.append(Assignment(owner, name, spec, tuple(mapped)))
    return tuple(found)


def assigned_paths(module: nn.Module, before: dict[nn.Module, dict[str, Any]]) -> list[str]:
    """Paths of attributes changed since ``before`` (from :func:`snapshot`)."""
    return [f"{owner}.{name}" if owner else name for owner, name, _ in _changed(module, before, True)]


def snapshot(module: nn.Module) -> dict[nn.Module, dict[str, Any]]:
    return _attributes(module, True)


def _attributes(module: nn.Module, buffers: bool) -> dict[nn.Module, dict[str, Any]]:
    return {m: _plain(m, buffers) for m in module.modules()}


def _plain(module: nn.Module, buffers: bool) -> dict[str, Any]:
    found = plain_attributes(module)
    found.pop("forward", None)  # the recording wrapper, or the strategy's pipelined forward
    if isinstance(module, nn.RNNBase):
        # torch's own view of the weights, rebuilt in forward whenever they were swapped (as capture
        # swaps them): not state of the model, and rebuilt again by the next plain call
        found.pop("_flat_weights", None)
        found.pop("_flat_weight_refs", None)
    if buffers:
        found.update(module._buffers)
    return found


def _changed(module: nn.Module, before: dict[nn.Module, dict[str, Any]], buffers: bool) -> list[tuple[str, str, Any]]:
    paths = {}
    for path, m in module.named_modules(remove_duplicate=True):
        paths.setdefault(m, path)
    changes = []
    missing = object()
    for m, old in before.items():
        for key, value in _plain(m, buffers).items():
            if old.get(key, missing) is not value:
                changes.append((paths.get(m, ""), key, value))
    return changes


def per_sample(node: fx.Node, inputs: set[str]) -> bool:
    """Whether the value differs with the batch: it reads a batch input's values, or one of its dims
    is the graph's symbolic batch size. Reads of sizes alone (``x.size(1)``) do not count."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape):
        return True
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and current.name in inputs:
            return True
        if _is_size(current) and current is not node:
            continue
        stack.extend(current.all_input_nodes)
    return False


def _is_size(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, (int, torch.SymInt)) or "sym_size" in str(node.target)


DimOf = Callable[[str, list[torch.Tensor]], "int | None"]
"""The batch dim of an output's per-micro-batch values (by node name); ``None``: it has none."""


def assign(module: nn.Module, assignments: Sequence[Assignment], per_micro: Sequence[dict[str, Any]],
           sizes: Sequence[int | None], dim_of: DimOf | None = None) -> None:
    """Give each attribute the value a whole-batch call would: the per-micro-batch values of the
    graph's outputs (``per_micro``, by node name) joined on their batch dim (``dim_of``; by default
    the one dim that follows ``sizes``) where they are per-sample, the common value where they are
    not. Raises :class:`AssignmentError` where neither holds."""
    dim_of = dim_of or _only_following_dim(sizes)
    for assignment in assignments:
        leaves = [_joined(assignment, leaf, [values[leaf.node] for values in per_micro], sizes, dim_of)
                  if isinstance(leaf, Output) else leaf for leaf in assignment.leaves]
        owner = module.get_submodule(assignment.owner)
        value = pytree.tree_unflatten(leaves, assignment.spec)
        current = owner._buffers.get(assignment.name)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and _same_layout(current, value):
            with torch.no_grad():
                current.copy_(value)  # keeps the buffer object, and the device its stage placed it on
        else:
            setattr(owner, assignment.name, value)


def _only_following_dim(sizes: Sequence[int | None]) -> DimOf:
    def dim_of(name: str, values: list[torch.Tensor]) -> int | None:
        candidates = batch_dim_candidates(values, sizes)
        return candidates[0] if len(candidates) == 1 else None
    return dim_of


def _joined(assignment: Assignment, leaf: Output, values: list[Any], sizes: Sequence[int | None],
            dim_of: DimOf) -> Any:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if torch.is_grad_enabled() and (leaf.requires_grad or any(t.requires_grad for t in tensors)):
        raise AssignmentError(
            f"forward assigns self.{assignment.path} a tensor that needs gradients. The pipeline runs forward "
            "once per micro-batch, and an attribute cannot carry gradients back through the pipeline. If a loss "
            "needs it (an auxiliary loss), return it from forward instead; if it is only kept to look at, "
            "assign it .detach()ed."
        )
    if len(values) == 1:
        return values[0]
    if leaf.per_sample:
        dim = dim_of(leaf.node, tensors) if len(tensors) == len(values) else None
        if dim is not None:
            device = tensors[-1].device
            return torch.cat([t.to(device) for t in tensors], dim)
        shapes = [tuple(t.shape) for t in tensors]
        raise AssignmentError(
            f"forward assigns self.{assignment.path} a value computed from the batch, but not one row per sample "
            f"(shapes {shapes} for micro-batches of {list(sizes)}). The pipeline runs forward once per "
            "micro-batch and cannot tell what a whole-batch call would have stored. Return it from forward "
            "instead, or compute it outside the pipelined module."
        )
    first = values[0]
    if all(_equal(first, v) for v in values[1:]):
        return values[-1]
    raise AssignmentError(
        f"forward assigns self.{assignment.path} a value that differs from micro-batch to micro-batch, so no "
        "single value is the one a whole-batch call would have stored. Return it from forward instead, or "
        "compute it outside the pipelined module."
    )


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and not a.is_inference()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
    return type(a) is type(b) and a == b
