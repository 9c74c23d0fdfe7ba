"""How attributes assigned in ``forward`` carry over from one call to the next.

:mod:`.assignments` makes the values ``forward`` assigns outputs of the graph. Whether replaying
them after each call is right depends on what the next call would do, which the code does not say
(``if self.src_mask is None``, ``self.calls += 1``, ``if not self.initialized``). Capturing a second
time, from the state one call leaves, and comparing the two graphs does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..torch_private import HigherOrderOperator, OpOverload
from .assignments import assign, per_sample
from .errors import FrontendRefused
from .isolation import side_effects_undone
from .kept import KeptCache, kept
from .opgraph import OpGraph


def settle(
    module: nn.Module, call: tuple[tuple, dict], first: OpGraph, capture_again: Callable[[], OpGraph]
) -> tuple[OpGraph, Callable[[], KeptCache] | None]:
    """The graph to run for a ``forward`` that assigns attributes, and what to do once after capture
    (assign the cache; it returns the :class:`~.kept.KeptCache` the graph reads).

    ``first`` was captured from the module as it is; ``capture_again`` captures it with the same
    frontend from the module's state at the time. Capture again from the state one call leaves:
    - the same operations and the same constants assigned: every call does what the first did, so
      the runtime runs ``first`` and assigns the attributes again after each call;
    - some attributes no longer assigned (a cache such as ``self.src_mask``, built once, then
      reused), and from there on every call does the same: the state after one call is where the
      model stays, so it is kept (the attributes get the values one call on the example gives, as
      the first call would) and the second graph runs. Only if the cached values depend on the
      batch's shapes alone (not its values, nor parameters that training changes) and the first
      call wrote no other state. The runtime checks the cache on every call (:mod:`.kept`);
    - otherwise (a counter, a one-time initialisation from the batch) a captured graph cannot
      follow what plain calls do, and the frontend refuses.
    """
    second, values = _after_one_call(module, call, first, capture_again)
    if _replays(first, second):
        return first, None
    again = {a.path for a in second.assignments}
    cached = [a for a in first.assignments if a.path not in again]
    # a cache of the batch's values, or of parameters that training changes, is no cache of shapes
    stale_later = [a.path for a in cached if any(getattr(v, "per_sample", False) or getattr(
        v, "requires_grad", False) for v in a.leaves)]
    settles = bool(cached) and not stale_later and _only_first_does_is_pure(first, second)
    if settles and second.assignments:
        third, _ = _after_one_call(module, call, second, capture_again)
        settles = _replays(second, third)
    if settles:
        paths = [a.path for a in cached]
        return second, lambda: kept(module, paths, lambda: _assign_once(module, first, values))
    changed = ", ".join("self." + a.path for a in first.assignments)
    raise FrontendRefused(
        f"forward changes {changed}, and that changes what the next call "
        "does (a counter, or a one-time initialisation from the batch), which a captured graph cannot follow. "
        "Do it outside forward (in training_step or a callback), or give the attribute its final value before "
        "training"
    )


def _assign_once(module: nn.Module, graph: OpGraph, values: dict[str, Any]) -> None:
    with torch.no_grad():
        assign(module, graph.assignments, [values], [None])


def _after_one_call(
    module: nn.Module, call: tuple[tuple, dict], graph: OpGraph, capture_again: Callable[[], OpGraph]
) -> tuple[OpGraph, dict[str, Any]]:
    """The graph captured from the state one call of ``graph`` leaves, and that call's output values."""
    args, kwargs = call
    assert graph.graph_module is not None
    with side_effects_undone(module), torch.no_grad():
        values = _output_values(graph, graph.graph_module(*graph.bind(args, kwargs)))
    # copies: an attribute holding an input or a parameter must still look assigned to the next capture
    values = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
    _assign_once(module, graph, values)
    return capture_again(), values


def _replays(first: OpGraph, second: OpGraph) -> bool:
    """Whether ``second`` (captured after one call of ``first``) does and assigns what ``first`` does."""
    return _same_operations(first, second) and [(a.path, a.constants) for a in second.assignments] == [
        (a.path, a.constants) for a in first.assignments
    ]


def _output_values(graph: OpGraph, results: Any) -> dict[str, Any]:
    assert graph.graph_module is not None
    outputs = graph.graph_module.graph.output_node().args[0]
    return {node.name: value for node, value in zip(outputs, results) if isinstance(node, fx.Node)}


def _same_operations(first: OpGraph, second: OpGraph) -> bool:
    return [(n.kind, n.target, n.inputs, n.state) for n in first.nodes] == [
        (n.kind, n.target, n.inputs, n.state) for n in second.nodes
    ]


def _only_first_does_is_pure(first: OpGraph, second: OpGraph) -> bool:
    """Whether the operations ``first`` has and ``second`` lacks (what building a cache costs) read
    nothing of the batch and write no state: then skipping them from the second call on is exact.
    Operations are told apart by what they call: every target the batch reaches runs as often in
    both graphs, and every call of a target that ``first`` runs more often writes no state."""
    assert first.graph_module is not None and second.graph_module is not None
    extra = Counter(_targets(first.graph_module)) - Counter(_targets(second.graph_module))
    if _per_sample_targets(first.graph_module) != _per_sample_targets(second.graph_module):
        return False
    for node in first.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in extra:
            if isinstance(node.target, HigherOrderOperator) or _writes_state(node):
                return False
    return True


def _per_sample_targets(graph_module: fx.GraphModule) -> Counter:
    """How often each target runs on values that differ with the batch."""
    inputs = {n.name for n in graph_module.graph.nodes if n.op == "placeholder"}
    return Counter(n.target for n in graph_module.graph.nodes if n.op == "call_function" and per_sample(n, inputs))


def _targets(graph_module: fx.GraphModule) -> list[Any]:
    return [n.target for n in graph_module.graph.nodes if n.op == "call_function"]


def _writes_state(node: fx.Node) -> bool:
    """Whether ``node`` writes a parameter, a buffer or an input (or a view of one) in place."""
    target = node.target
    if not isinstance(target, OpOverload):
        return False
    arguments = target._schema.arguments
    written = [i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    return any(i < len(node.args) and _base_kind(node.args[i]) in ("get_attr", "placeholder") for i in written)


def _base_kind(value: Any) -> str | None:
    """The fx kind of the node whose storage ``value`` views (of ``value`` itself if it is no view)."""
    node = value
    while isinstance(node, fx.Node) and isinstance(node.target, OpOverload):
        returns = node.target._schema.returns
        if not (returns and returns[0].alias_info is not None and node.args):
            break
        node = node.args[0]
    return node.op if isinstance(node, fx.Node) else None
