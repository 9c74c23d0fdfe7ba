"""Sizes crossing a cut, read again from the tensors beside them instead of sent.

torch.distributed.pipelining sends tensors only, and an exported graph reads a size once (the
batch, the sequence length: ``aten.sym_size.int``) and uses it in every layer after, so nearly
every cut of a Hugging Face model carries an integer. Where the captured graph knows that integer
as a size of a tensor the stage receives anyway (the same symbol, ``s0``, as one of its dims), the
stage reads it from that tensor; a size the graph fixed as a number becomes that number. No stage
then sends it. A size that is neither stays a cut value, and the stage refuses it when it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from ..capture import OpGraph
from ..stages.split import StageModule, changed_in_place


def without_sizes(stages: list[StageModule], graph: OpGraph) -> list[StageModule]:
    """``stages`` with each size crossing a cut read in the stage that needs it, where it can be."""
    assert graph.graph_module is not None
    values = {n.name: n.meta.get("val") for n in graph.graph_module.graph.nodes}
    last = len(stages) - 1
    readable = [_readable(stage, values) for stage in stages]
    # a stage stops sending a size that the next one reads itself; the last sends the model's outputs
    return [_rewritten(stage, readable[k], set(readable[k + 1]) if k < last else set())
            for k, stage in enumerate(stages)]


def _readable(stage: StageModule, values: dict[str, Any]) -> dict[str, tuple[str, int] | int]:
    """For each size among the stage's inputs: the input tensor and dim it can be read from, or the
    number it is."""
    tensors = [(name, values.get(name)) for name in stage.inputs if isinstance(values.get(name), torch.Tensor)]
    found: dict[str, tuple[str, int] | int] = {}
    for name in stage.inputs:
        value = values.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            continue
        if isinstance(value, int):
            found[name] = value
            continue
        for tensor_name, tensor in tensors:
            dim = next((d for d, size in enumerate(tensor.shape) if _same_size(size, value)), None)
            if dim is not None:
                found[name] = (tensor_name, dim)
                break
    return found


def _same_size(size: Any, value: torch.SymInt) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr == value.node.expr


def _rewritten(stage: StageModule, readable: dict[str, tuple[str, int] | int], not_sent: set[str]) -> StageModule:
    if not readable and not (not_sent & set(stage.outputs)):
        return stage
    module = stage.module
    graph = module.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    first_other = next(n for n in graph.nodes if n.op != "placeholder")
    for name, source in readable.items():
        node = placeholders[name]
        with graph.inserting_before(first_other):
            if isinstance(source, int):
                replacement: Any = source
            else:
                tensor, dim = source
                replacement = graph.call_function(torch.ops.aten.sym_size.int, (placeholders[tensor], dim))
        if isinstance(replacement, fx.Node):
            node.replace_all_uses_with(replacement)
        else:
            _inline(node, replacement)
        graph.erase_node(node)
    output = graph.output_node()
    kept = [(name, value) for name, value in zip(stage.outputs, output.args[0]) if name not in not_sent]
    output.args = (tuple(value for _, value in kept),)
    graph.lint()
    module.recompile()
    remaining = [n for n in graph.nodes if n.op == "placeholder"]
    return dataclasses.replace(
        stage,
        inputs=tuple(name for name in stage.inputs if name not in readable),
        outputs=tuple(name for name, _ in kept),
        mutated=frozenset(i for i, p in enumerate(remaining) if changed_in_place(module, p)),
    )


def _inline(node: fx.Node, number: int) -> None:
    """Put ``number`` wherever ``node`` is used."""
    for user in list(node.users):
        user.args = fx.node.map_arg(user.args, lambda n: number if n is node else n)
        user.kwargs = fx.node.map_arg(user.kwargs, lambda n: number if n is node else n)
