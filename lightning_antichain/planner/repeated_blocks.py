"""Blocks of a captured graph that repeat another block operation for operation.

A 70 B decoder is 80 layers whose captured graphs are equal but for their names: the same
operations on parameters of the same shapes, wired alike. Timing does not depend on values, so
the profiler measures the first such block and gives each repeat its measurements, node for node,
after checking at run time that the repeat's inputs have the first one's shapes
(:mod:`.just_in_time`). Planning such a model then costs a few layers' time, not all of them.

A block is the operations issued by one element of a module list (``model.layers.17``): the owner
path up to its first numeric part. Its signature is each operation's target, its constant
arguments, the shapes and dtypes of the state it reads (named relative to the block), and how its
inputs are wired: to an earlier operation of the block, or to the block's n-th outside input.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..capture import OpGraph
from ..capture.opgraph import AttrFetch, block_of


@dataclass
class Block:
    """One block's operations in execution order, and the outside nodes they read, in order of use."""

    name: str
    nodes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Repeat:
    """``block`` repeats ``reference``: its nodes and outside inputs map onto the reference's."""

    block: Block
    reference: Block

    def node_map(self) -> dict[str, str]:
        """Each node and outside input of the repeat -> the reference's."""
        return {**dict(zip(self.block.inputs, self.reference.inputs)), **dict(zip(self.block.nodes,
                                                                                  self.reference.nodes))}


def find_repeats(graph: OpGraph, graph_module: fx.GraphModule) -> list[Repeat]:
    """Every block whose signature equals an earlier block's, paired with the first such block."""
    blocks = _blocks(graph, graph_module)
    first: dict[Hashable, Block] = {}
    repeats = []
    for block in blocks.values():
        key = _signature(block, graph, graph_module)
        reference = first.setdefault(key, block)
        if reference is not block:
            repeats.append(Repeat(block, reference))
    return repeats


def _owner(graph: OpGraph, node: fx.Node) -> str:
    return str(node.target) if node.op == "call_module" else graph[node.name].owner


def _blocks(graph: OpGraph, graph_module: fx.GraphModule) -> dict[str, Block]:
    blocks: dict[str, Block] = {}
    for node in graph_module.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        name = block_of(_owner(graph, node))
        if name is not None:
            blocks.setdefault(name, Block(name)).nodes.append(node.name)
    nodes = {n.name: n for n in graph_module.graph.nodes}
    for block in blocks.values():
        inside = set(block.nodes)
        for name in block.nodes:
            for source in nodes[name].all_input_nodes:
                if source.name not in inside and source.name not in block.inputs:
                    block.inputs.append(source.name)
    return blocks


def _signature(block: Block, graph: OpGraph, graph_module: fx.GraphModule) -> Hashable:
    nodes = {n.name: n for n in graph_module.graph.nodes}
    local = {name: i for i, name in enumerate(block.nodes)}
    outside = {name: i for i, name in enumerate(block.inputs)}
    prefix = block.name + "."

    def relative(path: str) -> str:
        if path == block.name:
            return ""
        return path[len(prefix):] if path.startswith(prefix) else "=" + path

    def wired(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value.name in local:
                return ("local", local[value.name])
            if value.op == "get_attr":
                fetched = AttrFetch(graph_module, str(value.target))()
                shape = (tuple(fetched.shape), str(fetched.dtype)) if isinstance(fetched, torch.Tensor) else None
                return ("state", relative(str(value.target)), shape)
            return ("outside", outside[value.name])
        if isinstance(value, (list, tuple)):
            return tuple(wired(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, wired(v)) for k, v in value.items()))
        return repr(value)

    key = []
    for name in block.nodes:
        node = nodes[name]
        target = relative(str(node.target)) if node.op == "call_module" else str(node.target)
        state = []
        if node.op == "call_module":
            module = graph_module.get_submodule(str(node.target))
            state = [(n, tuple(t.shape), str(t.dtype)) for n, t in [*module.named_parameters(),
                                                                   *module.named_buffers()]]
        key.append((node.op, target, relative(_owner(graph, node)), wired(node.args), wired(node.kwargs),
                    tuple(state), _shapes(node)))
    return tuple(key)


def _shapes(node: fx.Node) -> Any:
    """The shapes export recorded for ``node``'s output (none for other frontends)."""
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        return tuple(_shape_of(v) for v in value)
    return _shape_of(value) if isinstance(value, torch.Tensor) else None


def _shape_of(value: Any) -> Any:
    return (tuple(str(s) for s in value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else repr(value)
