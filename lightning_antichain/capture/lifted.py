"""Put the user's parameters and buffers back into an ATen graph that lifted them to inputs.

torch.export and ``make_fx`` turn every parameter and buffer into a graph input. The runtime needs
the opposite: each stage must read and update the user's own tensors, so gradients land in the
original parameters, BatchNorm statistics in the original buffers, and ``state_dict()`` keys never
change. :func:`rebuild_over_module` turns those inputs back into ``get_attr`` nodes naming the
tensors by qualified name, and :func:`share_original_modules` makes a graph module resolve those
names through the user's live module objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.fx as fx
from torch import nn


def rebuild_over_module(
    source: fx.Graph,
    module: nn.Module,
    state: Mapping[str, str],
    constants: Mapping[str, Any],
    attributes: nn.Module | None,
    input_names: Mapping[str, str],
    name: str,
) -> fx.GraphModule:
    """A graph module over ``module`` with the same operations as ``source``.

    ``state`` maps placeholder names to qualified parameter or buffer names of ``module``;
    ``constants`` maps placeholder names to lifted constant values; other placeholders stay inputs,
    renamed by ``input_names`` where given. ``get_attr`` nodes of ``source`` (constants and
    sub-graphs of higher-order ops) are resolved on ``attributes``. Constants and sub-graphs get
    names in order of first use, so capturing the same code twice gives the same graph.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    counts = {"constant": 0, "submodule": 0}

    def fresh_attr(value: Any) -> str:
        kind = "submodule" if isinstance(value, nn.Module) else "constant"
        attr = f"_capture_{kind}{counts[kind]}"
        counts[kind] += 1
        attrs[attr] = value
        return attr

    for node in source.nodes:
        if node.op == "placeholder":
            if node.name in state:
                target = state[node.name]
                attrs[target] = _lookup(module, target)
                new = graph.get_attr(target)
            elif node.name in constants:
                new = graph.get_attr(fresh_attr(constants[node.name]))
            else:
                new = graph.placeholder(input_names.get(node.name, node.name))
        elif node.op == "get_attr":
            assert attributes is not None
            new = graph.get_attr(fresh_attr(_lookup(attributes, str(node.target))))
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], env.__getitem__))
            continue
        else:
            new = graph.node_copy(node, env.__getitem__)
        new.meta = dict(node.meta)
        env[node] = new
    graph_module = fx.GraphModule(attrs, graph, name)
    share_original_modules(graph_module, module)
    return graph_module


def share_original_modules(graph_module: fx.GraphModule, module: nn.Module) -> fx.GraphModule:
    """Make ``graph_module``'s top-level submodules the user's own, so every lookup is live.

    fx copies the attributes a graph reads into fresh container modules; a buffer that the user's
    module later replaces (``module.to(...)`` makes new buffer tensors) would then be stale.
    Resolving names through the original modules always finds the current tensors.
    """
    originals = dict(module.named_children())
    for child in list(graph_module._modules):
        if child in originals:
            setattr(graph_module, child, originals[child])
    return graph_module


def _lookup(root: Any, target: str) -> Any:
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def input_placeholder_names(paths: list[str]) -> list[str]:
    """Readable, distinct placeholder names for flattened inputs, from their pytree key paths."""
    names: list[str] = []
    seen: set[str] = set()
    for path in paths:
        base = "".join(c if c.isalnum() else "_" for c in path).strip("_") or "input"
        base = base[2:] if base.startswith("1_") else base  # the kwargs half of (args, kwargs)
        if base[0].isdigit():
            base = "arg" + base
        candidate, k = base, 1
        while candidate in seen:
            k += 1
            candidate = f"{base}_{k}"
        seen.add(candidate)
        names.append(candidate)
    return names

