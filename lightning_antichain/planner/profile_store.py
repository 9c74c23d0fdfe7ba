"""Cost graphs kept in the cache, so a rerun with the same model and shapes skips profiling.

The key covers everything that changes the measurements: the captured graph's code, every
parameter and buffer's name, shape and dtype, the example inputs' shapes and dtypes, the device's
name, the autocast dtype and the torch version. Weights' values do not change costs and are not
part of it. An entry is only used if it describes the captured graph exactly (the same operations,
the same dependencies, numbers where numbers belong), since a plan from a wrong cost graph is a
wrong plan.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn

from ..capture import OpGraph
from ..capture.pytrees import iter_tensors
from ..device import autocast_settings, device_name
from .cache import DamagedEntry, entry_key, entry_path, read_entry, write_entry
from .cost_graph import cost_graph_from_dict, cost_graph_to_dict

_NUMBERS = ("forward_s", "backward_s", "output_bytes", "param_bytes", "buffer_bytes")
# frozen_bytes (no gradient, no optimizer state) is checked when present: profiles cached before it have none


def profile_key(graph: OpGraph, module: nn.Module, example: Any, device: torch.device) -> str:
    """The cache key of the costs of ``module`` on ``example`` at ``device``."""
    code = graph.graph_module.code if graph.graph_module is not None else repr([n.name for n in graph.nodes])
    state = [(name, tuple(t.shape), str(t.dtype), t.requires_grad)
             for name, t in [*module.named_parameters(), *module.named_buffers()]]
    inputs = [(tuple(t.shape), str(t.dtype)) for t in iter_tensors(example)]
    autocast = [str(dtype) for _, dtype in autocast_settings()]
    return entry_key("profile", code, state, inputs, device_name(device), autocast, torch.__version__,
                     torch.get_num_threads())


def profile_file(directory: Path, key: str) -> Path:
    return entry_path(directory, "profile", key)


def load_profile(directory: Path, key: str, graph: OpGraph | None = None) -> nx.DiGraph | None:
    """The cached cost graph of ``key``, if there is one and it describes ``graph`` exactly."""
    return read_entry(directory, "profile", key, lambda data: _validated(data, graph))


def store_profile(directory: Path, key: str, cost: nx.DiGraph) -> Path | None:
    return write_entry(directory, "profile", key, cost_graph_to_dict(cost))


def _validated(data: Any, graph: OpGraph | None) -> nx.DiGraph:
    listed = {node["name"] for node in data["nodes"]}  # edges alone would re-create a missing node
    cost = cost_graph_from_dict(data)
    if graph is None:
        return cost
    if listed != set(cost.nodes):
        raise DamagedEntry("it lists operations that are only named by its edges")
    problem = mismatch(cost, graph, data)
    if problem is not None:
        raise DamagedEntry(problem)
    return cost


def mismatch(cost: nx.DiGraph, graph: OpGraph, data: dict[str, Any]) -> str | None:
    """Why ``cost`` (read from ``data``) is not the cost graph of ``graph`` (``None`` if it is)."""
    expected_nodes = {n.name for n in graph.nodes}
    nodes = set(cost.nodes)
    if nodes != expected_nodes:
        missing, unknown = sorted(expected_nodes - nodes)[:5], sorted(nodes - expected_nodes)[:5]
        return f"its operations differ from the model's (missing {missing}, unknown {unknown})"
    expected_edges = {(src, n.name) for n in graph.nodes for src in (*n.inputs, *n.after)}
    if set(cost.edges) != expected_edges:
        return "its dependencies differ from the model's"
    for attrs in data["nodes"]:
        name = attrs["name"]
        for field in _NUMBERS:
            value = attrs.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                return f"operation {name!r} has {field} = {value!r}, not a non-negative number"
    if sorted(map(sorted, cost.graph.get("together", []))) != sorted(map(sorted, graph.together)):
        return "its groups of operations that must share a stage differ from the model's"
    return None
