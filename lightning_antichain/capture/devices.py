"""Devices named inside a captured graph.

ATen graphs from torch.export and concrete capture name the device of every tensor they create
(``arange(..., device=cpu)``): the device the example was on. A stage that runs on another device
must create its tensors there, so those names are rewritten for each stage. fx graphs read devices
from their inputs at run time and need nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..runtime.device import is_meta, same_device


def retarget_devices(graph_module: fx.GraphModule, source: str | torch.device | None,
                     target: str | torch.device) -> fx.GraphModule:
    """Rewrite every ``source`` device constant in ``graph_module`` to ``target``, in place.

    ``meta`` is rewritten too: a graph captured from a model built on the meta device names it
    where forward creates a tensor on a parameter's device, and nothing runs on meta."""
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

    for node in graph_module.graph.nodes:
        if node.op in ("call_function", "call_method"):
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    if swapped:
        graph_module.recompile()
    return graph_module



def on_module_device(module: torch.nn.Module, values: Any) -> Any:
    """``values`` with their tensors on the device that holds all of ``module``'s parameters and
    buffers (unchanged when they are spread or absent). torch.export traces a module and its example
    on one device; a Pipeline's module waits on the CPU for its stages while the batch is already on
    a GPU, and the graph's device constants are retargeted per stage anyway."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    if len(devices) != 1:
        return values
    (device,) = devices
    return torch.utils._pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) and not same_device(v.device, device) else v, values)
