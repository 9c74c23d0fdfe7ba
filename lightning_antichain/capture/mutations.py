"""In-place operations and the order they impose beyond data flow.

``h.relu_()`` changes ``h`` without a new value: the fx node has no users, and nothing in the data
flow orders it before a later ``net_2(h)``. A plan could then run ``net_2`` a stage earlier and read
``h`` before the ReLU. :func:`ordering` gives each operation the extra predecessors it needs: every
reader of the mutated tensor (or of a view or alias of it) comes after the mutation if it came
after it in ``forward``, and before it otherwise. The planner then never separates them the wrong
way round.

Whether a call may write or alias is decided erring towards yes: a needless edge costs a little
freedom in planning, a missing one a wrong result.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from ..torch_private import OpOverload


@dataclass
class MutationOrder:
    """What in-place operations require of a plan: ``after[name]`` are nodes that must run before
    ``name`` besides its inputs; each set of ``together`` must share a stage. A view taken before
    the change and read after it must be computed where the change happens: shipped to another
    stage on its own, it would be a copy that no longer sees the change."""

    after: dict[str, tuple[str, ...]] = field(default_factory=dict)
    together: list[tuple[str, ...]] = field(default_factory=list)


def ordering(graph_module: fx.GraphModule) -> MutationOrder:
    """The ordering that the in-place operations of ``graph_module`` impose."""
    nodes = list(graph_module.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    after: dict[str, set[str]] = defaultdict(set)
    together: list[tuple[str, ...]] = []
    for node in nodes:
        written = written_arguments(graph_module, node)
        if not written:
            continue
        members = _storage_sharers(graph_module, written)
        for reader in {u for m in members for u in m.users} | (members - set(written)):
            if reader is node or reader.op in ("output", "get_attr", "placeholder"):
                continue
            if position[reader] > position[node]:
                after[reader.name].add(node.name)
            else:
                after[node.name].add(reader.name)
        views = [m for m in members - set(written) if m.op == "call_function" or m.op == "call_method"
                 if position[m] < position[node] and any(position[u] > position[node] for u in m.users)]
        if views:
            together.append(tuple(sorted({node.name, *(v.name for v in views)}, key=lambda n: n)))
    order = {n.name: i for n, i in position.items()}
    return MutationOrder({name: tuple(sorted(before, key=order.__getitem__)) for name, before in after.items()},
                         together)


def written_arguments(module: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The argument nodes ``node`` may change in place (``ReLU(inplace=True)``, ``x.add_``, ``aten.add_``)."""
    target = node.target
    if isinstance(target, OpOverload):
        arguments = target._schema.arguments
        return [node.args[i] for i, a in enumerate(arguments)
                if a.alias_info is not None and a.alias_info.is_write and i < len(node.args)
                and isinstance(node.args[i], fx.Node)]
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None:
        return []
    if node.op == "call_module":
        return [first] if getattr(module.get_submodule(str(target)), "inplace", False) else []
    if node.op == "call_method":
        name = str(target)
        return [first] if name.endswith("_") and not name.startswith("__") else []
    if node.op == "call_function":
        name = getattr(target, "__name__", "")
        in_place = (
            bool(node.kwargs.get("inplace"))
            or (name.startswith("i") and name in _IN_PLACE_OPERATORS)
            or (name.endswith("_") and not name.startswith("_"))
        )
        return [first] if in_place else []
    return []


def is_in_place(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may change an argument in place."""
    return bool(written_arguments(module, node))


def may_alias(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with its first argument (erring towards yes)."""
    target = node.target
    if isinstance(target, OpOverload):
        returns = target._schema.returns
        return bool(returns and returns[0].alias_info is not None) or "dropout" in target.name()
    if node.op == "call_module":
        sub = module.get_submodule(str(target))
        if not type(sub).__module__.startswith("torch.nn"):
            return True  # a user leaf module may return its input as is
        return isinstance(sub, (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)) or bool(
            getattr(sub, "inplace", False)
        )
    name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
    return name in _ALIASING_CALLS or (name.endswith("_") and not name.startswith("_"))


def _storage_sharers(module: fx.GraphModule, written: list[fx.Node]) -> set[fx.Node]:
    """The nodes whose values may share storage with ``written``: its bases, their views, and for a
    parameter or buffer every fetch of it."""
    members: set[fx.Node] = set()
    stack = list(written)
    while stack:
        node = stack.pop()
        if node in members:
            continue
        members.add(node)
        if node.op == "get_attr":
            stack.extend(n for n in node.graph.nodes if n.op == "get_attr" and n.target == node.target)
        if node.op not in ("placeholder", "get_attr") and may_alias(module, node):
            stack.extend(a for a in node.args[:1] if isinstance(a, fx.Node))
        stack.extend(u for u in node.users if may_alias(module, u))
    return members


_IN_PLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor"}

_ALIASING_CALLS = {
    "getitem", "__getitem__", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze",
    "unsqueeze", "transpose", "t", "permute", "expand", "expand_as", "narrow", "select", "unbind", "split", "chunk",
    "tensor_split", "movedim", "moveaxis", "swapaxes", "contiguous", "detach", "as_strided", "view_as_real",
    "view_as_complex", "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda", "dropout",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "identity",
}
