"""The planning-only view of a model no frontend captures: its top-level children as nodes.

Each call of a top-level child module is a node, in call order; edges follow the tensors handed
from one child to the next, found by running the model once with hooks. The graph can be planned
and compared with others, not run as a pipeline.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from .errors import UntraceableModelError
from .opgraph import OpGraph, OpNode, RecordedCall
from .opgraph import identity as _identity
from .pytrees import iter_tensors
from .signature import split_inputs


def children_instead(module: nn.Module, example_inputs: Any, refusal: UntraceableModelError) -> OpGraph:
    """The planning-only graph of ``module``'s top-level children, for a model no frontend captured."""
    if example_inputs is None:
        raise UntraceableModelError(
            f"{refusal}\nThe 'children' fallback needs example inputs to observe the data flow."
        ) from refusal
    graph = trace_children(module, example_inputs)
    warnings.warn(
        f"{refusal}\nSo {type(module).__name__} was profiled at its {len(graph)} top-level children instead, which "
        "a plan can compare but a Pipeline cannot run (fallback=None raises this instead).",
        stacklevel=3,
    )
    graph.note = "fell back to top-level children (planning only): no capture frontend succeeded"
    graph.refused = refusal.refused
    return graph



def trace_children(module: nn.Module, example_inputs: Any) -> OpGraph:
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
