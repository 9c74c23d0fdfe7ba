"""Devices named inside a captured graph.

ATen graphs from torch.export and concrete capture name the device of every tensor they create
(``arange(..., device=cpu)``): the device the example was on. A stage that runs on another device
must create its tensors there, so those names are rewritten for each stage. fx graphs read devices
from their inputs at run time and need nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..device import is_meta, same_device
from ..torch_private import pytree


def retarget_devices(graph_module: fx.GraphModule, source: str | torch.device | None,
                     target: str | torch.device) -> fx.GraphModule:
    """Rewrite every ``source`` device constant in ``graph_module`` to ``target``, in place.

    ``meta`` is rewritten too: a graph captured from a model built on the meta device names it
    where forward creates a tensor on a parameter's device, and nothing runs on meta. Graphs that
    the graph calls as higher-order operations' bodies (``wrap_with_set_grad_enabled``, ``cond``)
    are rewritten with it: torch.export puts device checks (``_assert_tensor_metadata``) there too."""
    target = torch.device(target)
    sources = [] if is_meta(target) else [torch.device("meta")]
    if source is not None and not same_device(torch.device(source), target):
        sources.append(torch.device(source))
    if not sources:
        return graph_module

    swapped: list[bool] = []

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and any(same_device(value, s) for s in sources):
            swapped.append(True)
            return target
        return value

    def rewrite(module: fx.GraphModule) -> None:
        swapped.clear()
        for node in module.graph.nodes:
            if node.op in ("call_function", "call_method"):
                node.args = fx.node.map_aggregate(node.args, swap)
                node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if swapped:
            module.recompile()

    for body in _graph_bodies(graph_module):
        rewrite(body)
    return graph_module


def _graph_bodies(graph_module: fx.GraphModule) -> list[fx.GraphModule]:
    """``graph_module`` and, depth first, every graph module its ``get_attr`` nodes fetch (the
    bodies of higher-order operations), each once."""
    found: list[fx.GraphModule] = []
    pending = [graph_module]
    while pending:
        module = pending.pop()
        if any(module is f for f in found):
            continue
        found.append(module)
        for node in module.graph.nodes:
            if node.op == "get_attr":
                try:
                    fetched = module.get_submodule(str(node.target))
                except AttributeError:  # a parameter, buffer or constant
                    continue
                if isinstance(fetched, fx.GraphModule):
                    pending.append(fetched)
    return found



def on_module_device(module: torch.nn.Module, values: Any) -> Any:
    """``values`` with their tensors on the device that holds all of ``module``'s parameters and
    buffers (unchanged when they are spread or absent). torch.export traces a module and its example
    on one device; a Pipeline's module waits on the CPU for its stages while the batch is already on
    a GPU, and the graph's device constants are retargeted per stage anyway."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    if len(devices) != 1:
        return values
    (device,) = devices
    return pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) and not same_device(v.device, device) else v, values)


@contextlib.contextmanager
def state_on_meta(module: nn.Module, call: tuple[tuple, dict], inputs_too: bool
                  ) -> Iterator[tuple[tuple[tuple, dict], Callable[[nn.Module], None]]]:
    """While the block runs, every real parameter and buffer of ``module`` behind a meta stand-in,
    where ``module`` has any state on meta (else all as is). Yields ``call``, on meta if
    ``inputs_too``, and ``put_back(graph_module)``, which gives a graph module made in the block
    the real tensors where it took a stand-in itself (a tensor of the root module, which it holds
    rather than reads through a submodule).

    A model built on meta usually has real buffers (made in ``__init__``) and takes real inputs.
    torch.export traces on one device or refuses ("weight is on meta, different from other tensors
    on cpu"), so it gets meta inputs too; concrete capture reads the inputs' values (a mask
    checked for causality) and keeps them real. Either graph reads every tensor of the module by
    name, so the stand-ins are never kept, and its device constants are retargeted per stage."""
    state = list(named_state(module))
    if not any(t.is_meta for _, _, t in state):
        yield call, lambda graph_module: None
        return
    with behind_meta_stand_ins([(table, name, t) for table, name, t in state if not t.is_meta]) as originals:

        def put_back(graph_module: nn.Module) -> None:
            for table, name, tensor in named_state(graph_module, recurse=False):
                table[name] = originals.get(id(tensor), tensor)

        yield (call if not inputs_too else pytree.tree_map(
            lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v, call)), put_back


State = tuple[dict[str, Any], str, torch.Tensor]
"""A parameter or buffer as its module holds it: the module's table, its name, the tensor."""


def named_state(module: nn.Module, recurse: bool = True) -> Iterator[State]:
    """Every parameter and buffer of ``module`` (and below it), with the table that holds it."""
    for sub in module.modules() if recurse else [module]:
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None:
                    yield table, name, tensor


@contextlib.contextmanager
def behind_meta_stand_ins(state: list[State]) -> Iterator[dict[int, torch.Tensor]]:
    """While the block runs, each of ``state`` held behind a meta tensor of its shape (a
    Parameter for a Parameter); yields each stand-in's original by the stand-in's ``id``. Only
    the modules' tables change, never the tensors."""
    originals: dict[int, torch.Tensor] = {}
    for table, name, tensor in state:
        stand_in = torch.empty_like(tensor, device="meta")
        table[name] = nn.Parameter(stand_in, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else stand_in
        originals[id(table[name])] = tensor
    try:
        yield originals
    finally:
        for table, name, tensor in state:
            table[name] = tensor

