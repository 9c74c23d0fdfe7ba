"""Turn an ``nn.Module`` into a graph of operations that the planner can cost and cut.

Two granularities exist:

* ``"ops"``: the capture chain of :mod:`lightning_antichain.capture` (fx, then torch.export, then
  concrete capture, then fx with blocks kept whole). Every operation is a node and tensors are the
  edges: the fine cut points and exact data dependencies the method of the paper needs.
* ``"children"``: a planning-only view for models no frontend captures. Each call of a top-level
  child module is a node, in call order; edges follow the tensors handed from one child to the
  next, found by running the model once. It can be planned and compared, not run as a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .capture import FRONTENDS, OpGraph, OpNode, RecordedCall, UntraceableModelError, capture
from .capture.opgraph import identity as _identity
from .capture.signature import bind_placeholders
from .pytrees import flatten, unflatten

GRANULARITIES = ("ops", "children")

__all__ = [
    "GRANULARITIES",
    "OpGraph",
    "OpNode",
    "RecordedCall",
    "UntraceableModelError",
    "bind_placeholders",
    "iter_tensors",
    "map_tensors",
    "split_inputs",
    "trace",
]


def trace(
    module: nn.Module,
    example_inputs: Any = None,
    *,
    granularity: str = "ops",
    fallback: str | None = "children",
    leaf_modules: Sequence[type | str] = (),
    frontends: Sequence[str] = FRONTENDS,
    batch_dim: int | Mapping[str, int] = 0,
) -> OpGraph:
    """Build the :class:`OpGraph` of ``module``.

    ``granularity="ops"`` captures through the chain of ``frontends`` (export and concrete capture
    need ``example_inputs``, one micro-batch). If no frontend succeeds and ``fallback="children"``,
    the top-level children become the nodes, for planning only; with ``fallback=None`` an
    :class:`UntraceableModelError` gives every frontend's reason. ``leaf_modules`` keeps the listed
    module classes or dotted paths whole.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if fallback not in (None, "children"):
        raise ValueError(f"fallback must be None or 'children', got {fallback!r}")
    if granularity == "ops":
        try:
            return capture(module, example_inputs, leaf_modules=leaf_modules, frontends=frontends,
                           batch_dim=batch_dim)
        except UntraceableModelError as exc:
            if fallback is None:
                raise
            return children_instead(module, example_inputs, exc)
    if example_inputs is None:
        raise ValueError("granularity='children' needs example_inputs to observe the data flow")
    return _trace_children(module, example_inputs)


def children_instead(module: nn.Module, example_inputs: Any, refusal: UntraceableModelError) -> OpGraph:
    """The planning-only graph of ``module``'s top-level children, for a model no frontend captured."""
    if example_inputs is None:
        raise UntraceableModelError(
            f"{refusal}\nThe 'children' fallback needs example inputs to observe the data flow."
        ) from refusal
    graph = _trace_children(module, example_inputs)
    graph.note = "fell back to top-level children (planning only): no capture frontend succeeded"
    graph.refused = refusal.refused
    return graph


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it, containers and their types kept."""
    leaves, spec = flatten(value)
    return unflatten([fn(v) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def _trace_children(module: nn.Module, example_inputs: Any) -> OpGraph:
    if not any(True for _ in module.children()):
        raise UntraceableModelError(
            f"{type(module).__name__} has no child modules to fall back on; it cannot be pipelined."
        )
    args, kwargs = split_inputs(example_inputs)
    records, outputs = _observe_children(module, args, kwargs)
    return OpGraph(module, [r.node for r in records], outputs, "children", recorder=_record_child_calls)


def _record_child_calls(graph: OpGraph, args: tuple, kwargs: dict) -> Iterator[RecordedCall]:
    records, _ = _observe_children(graph.module, args, kwargs)
    if [r.node.name for r in records] != [n.name for n in graph.nodes]:
        raise RuntimeError(
            f"{type(graph.module).__name__} called its children in a different order on these inputs; "
            "the children fallback needs a fixed call order."
        )
    yield from records


def _observe_children(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list[RecordedCall], tuple]:
    """Run the model once with hooks on its children, recording calls and the tensors between them."""
    producer: dict[int, str] = {}
    records: list[RecordedCall] = []
    for i, tensor in enumerate(iter_tensors((args, kwargs))):
        node = OpNode(f"input_{i}", "placeholder", f"input_{i}", ())
        producer[id(tensor)] = node.name
        records.append(RecordedCall(node, _identity, (tensor,), {}, tensor, None))
    n_inputs = len(records)
    counts: dict[str, int] = {}
    pending: dict[int, tuple[tuple, dict]] = {}

    def pre_hook(mod: nn.Module, hook_args: tuple, hook_kwargs: dict) -> None:
        pending[id(mod)] = (hook_args, dict(hook_kwargs))

    def post_hook(child_name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, hook_args: tuple, hook_kwargs: dict, output: Any) -> None:
            call_args, call_kwargs = pending.pop(id(mod), (hook_args, dict(hook_kwargs)))
            counts[child_name] = counts.get(child_name, 0) + 1
            name = child_name + ("" if counts[child_name] == 1 else f"_{counts[child_name]}")
            inputs: list[str] = []
            for tensor in iter_tensors((call_args, call_kwargs)):
                # A tensor made by code between children depends on the previous call.
                src = producer.get(id(tensor), records[-1].node.name)
                if src not in inputs:
                    inputs.append(src)
            if not inputs and len(records) > 0:
                inputs.append(records[-1].node.name)
            node = OpNode(name, "call_module", child_name, tuple(inputs))
            for tensor in iter_tensors(output):
                producer[id(tensor)] = name
            records.append(RecordedCall(node, mod, tuple(call_args), call_kwargs, output, mod))

        return hook

    handles = []
    for child_name, child in module.named_children():
        handles.append(child.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(child.register_forward_hook(post_hook(child_name), with_kwargs=True))
    try:
        result = module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if len(records) == n_inputs:
        raise UntraceableModelError(
            f"{type(module).__name__}.forward calls none of its child modules; it cannot be pipelined."
        )
    outputs = tuple(dict.fromkeys(producer.get(id(t), records[-1].node.name) for t in iter_tensors(result)))
    return records, outputs or (records[-1].node.name,)


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Lightning's ``example_input_array`` convention: tuple = positional, dict = keyword, else one arg."""
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return (example_inputs,), {}


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested value (tuples, lists, dicts, named tuples, dataclasses)."""
    return (v for v in flatten(value)[0] if isinstance(v, torch.Tensor))
