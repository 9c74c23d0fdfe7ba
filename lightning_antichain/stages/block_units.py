"""A stage's operations grouped by the block that issued them, each group a module of its own.

FSDP2 gathers a module's parameters around its forward and its backward, from hooks on the
module's call. A stage runs an op-level graph that reads parameters directly, so sharding the stage
as one module gathers all of it at once. Here each run of consecutive operations issued by one
block (``layers.17``, an element of a module list: a decoder layer) becomes a ``call_module`` on
an ``fx.GraphModule`` of its own that holds exactly the parameters those operations read, the
user's own objects. ``fully_shard`` on each then gathers one block at a time, prefetches the next,
and reduce-scatters a block's gradients as its backward ends, by torch's own hooks.

A parameter read by operations of several groups (a weight tied across blocks) stays with the
stage and enters each group as an argument, since FSDP2 manages a parameter in one module only.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from ..capture import OpGraph
from .split import StageModule

OPERATIONS = ("call_module", "call_function", "call_method")


@dataclass
class BlockUnit:
    """One group: the block that issued its operations, and the module that runs them, a
    submodule of the stage's graph module under ``name``."""

    block: str
    name: str
    module: fx.GraphModule


def outline_stage(stage: StageModule, graph: OpGraph) -> list[BlockUnit]:
    """``stage`` with its operations grouped by the blocks of ``graph`` that issued them
    (:func:`outline_blocks`), remembered in ``stage.block_units``."""
    block_of = {node.name: node.block for node in graph.nodes if node.block is not None}
    ungrouped = fx.GraphModule(stage.module, copy.deepcopy(stage.module.graph), type(stage.module).__name__)
    stage.block_units = outline_blocks(stage.module, block_of)
    if stage.block_units:
        stage.ungrouped = ungrouped
    for cached in ("called_modules", "trainable", "clocked_module", "compiled_module"):
        stage.__dict__.pop(cached, None)
    return stage.block_units


def outline_blocks(module: fx.GraphModule, block_of: Mapping[str, str]) -> list[BlockUnit]:
    """Rewrite ``module``'s graph in place so that each run of consecutive operations of one block
    (``block_of``: an operation's name -> its block; operations not named belong to none) is one
    call of a submodule running them, in the order they ran; returns the submodules in that order."""
    groups = [(block, nodes) for block, nodes in _groups(module.graph, block_of) if _reads_parameters(module, nodes)]
    units = []
    for index, (block, nodes) in enumerate(groups):
        name = f"block_unit_{index}"
        unit = _unit(module, nodes, f"Block_{block.replace('.', '_')}")
        module.add_submodule(name, unit)
        _replace(module.graph, nodes, name)
        units.append(BlockUnit(block, name, unit))
    if units:
        module.graph.lint()
        module.recompile()
    return units


def _groups(graph: fx.Graph, block_of: Mapping[str, str]) -> list[tuple[str, list[fx.Node]]]:
    """The runs of consecutive operations of one block, each with the ``get_attr`` nodes that only
    it reads."""
    runs: list[tuple[str, list[fx.Node]]] = []
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        block = block_of.get(node.name) if node.op in OPERATIONS else None
        if block is None:
            runs.append(("", []))  # breaks a run
            continue
        if not runs or runs[-1][0] != block:
            runs.append((block, []))
        runs[-1][1].append(node)
    groups = [(block, nodes) for block, nodes in runs if block and nodes]
    group_of = {node: i for i, (_, nodes) in enumerate(groups) for node in nodes}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        readers = {group_of.get(user) for user in node.users}
        if len(readers) == 1 and None not in readers:
            groups[readers.pop()][1].insert(0, node)  # type: ignore[index]
    return groups


def _reads_parameters(root: fx.GraphModule, nodes: list[fx.Node]) -> bool:
    """Whether the operations read a parameter (a group that reads none has nothing to shard)."""
    for node in nodes:
        if node.op == "call_module" and any(True for _ in root.get_submodule(str(node.target)).parameters()):
            return True
        if node.op == "get_attr" and isinstance(_attr(root, str(node.target)), nn.Parameter):
            return True
    return False


def _attr(root: nn.Module, target: str) -> object:
    value: object = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    inside = set(nodes)
    found: dict[fx.Node, None] = {}
    for node in nodes:
        for source in node.all_input_nodes:
            if source not in inside:
                found.setdefault(source)
    return list(found)


def _outputs(nodes: list[fx.Node]) -> list[fx.Node]:
    inside = set(nodes)
    return [node for node in nodes if any(user not in inside for user in node.users)]


def _unit(root: fx.GraphModule, nodes: list[fx.Node], class_name: str) -> fx.GraphModule:
    """A module running ``nodes`` on their outside inputs, returning the values used outside."""
    graph = fx.Graph()
    env = {source: graph.placeholder(source.name) for source in _inputs(nodes)}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[node] for node in _outputs(nodes)))
    return fx.GraphModule(root, graph, class_name)


def _replace(graph: fx.Graph, nodes: list[fx.Node], name: str) -> None:
    """``nodes`` replaced by one call of submodule ``name`` and a ``getitem`` per value used outside."""
    inputs, outputs = _inputs(nodes), _outputs(nodes)
    first_operation = next(node for node in nodes if node.op != "get_attr")
    order = {node: i for i, node in enumerate(graph.nodes)}
    for source in inputs:  # a tensor several groups read, fetched between this group's operations
        if order[source] > order[first_operation]:
            assert source.op == "get_attr", source
            first_operation.prepend(source)
    with graph.inserting_before(first_operation):
        call = graph.call_module(name, tuple(inputs))
        values = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for node, value in zip(outputs, values):
        node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in nodes)
    for node in reversed(nodes):
        graph.erase_node(node)
