"""The cost graph: a ``networkx.DiGraph`` of operations with what each one costs.

Node attributes (all optional except the graph being acyclic; missing ones default to zero):

==================  ====================================================================
``forward_s``       forward time of one micro-batch, seconds
``backward_s``      backward time of one micro-batch, seconds
``output_bytes``    bytes of the node's output for one micro-batch (what a cut ships)
``param_bytes``     bytes of the parameters the node owns
``params``          names of the parameters the node owns; ``frozen_params``: those not trained
``buffer_bytes``    bytes of the buffers the node owns (BatchNorm statistics, ...)
``saved``           storages the node's backward keeps, ``{key: bytes}`` (keys name storages, so
                    views and in-place results count once; see
                    :mod:`lightning_antichain.measure.saved_tensors`)
``storages``        the storages of the node's output, ``{key: bytes}``
``mutates``         keys of the storages the node changes in place
``saved_bytes``     bytes of the storages the node made that some node keeps (default:
                    ``output_bytes``); additive, for the planner's search
``pinned``          ``True`` for model inputs: present before any stage runs
``order``           position in execution order; ties in every algorithm break on it
``top_level``       the top-level child the node belongs to (for the block baseline)
==================  ====================================================================

Graph attributes: ``outputs`` (the nodes the model returns), ``together`` (groups of nodes that
must share a stage), ``micro_batch_size``, ``device``, ``granularity``, ``profile_s`` and so on, as
the profiler writes them. ``saved_counted`` says every node has ``saved`` and ``storages``; without
them a stage is taken to keep its inputs and every node's output.

A hand-made graph is a valid cost graph too::

    >>> import networkx as nx

from ..capture.opgraph import block_of
    >>> g = nx.DiGraph([("a", "b"), ("b", "c")])
    >>> nx.set_node_attributes(g, 1.0, "forward_s")
    >>> total_compute(normalize_cost_graph(g))
    3.0
"""

from __future__ import annotations

import json
import os
from typing import Any

import networkx as nx

from ..capture.opgraph import block_of

GRAPH_FORMAT = "lightning-antichain/cost-graph/1"

NODE_DEFAULTS: dict[str, Any] = {
    "forward_s": 0.0,
    "backward_s": 0.0,
    "output_bytes": 0,
    "param_bytes": 0,
    "frozen_bytes": 0,
    "buffer_bytes": 0,
    "pinned": False,
}


class CostGraphError(ValueError):
    """The cost graph cannot be planned (a cycle, negative costs, an unknown format)."""


def normalize_cost_graph(graph: nx.DiGraph, copy: bool = True) -> nx.DiGraph:
    """A copy of ``graph`` with every default attribute filled in, checked for plannability.

    Nodes without ``order`` get one from a deterministic topological sort; ``top_level`` defaults to
    the node's name; ``outputs`` defaults to the sinks. ``copy=False``: ``graph`` itself where it
    has every attribute already, for a caller that only reads it (a layout search cuts one cost
    graph a hundred times, and a copy of a 70 B decoder's takes a tenth of a second).
    """
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise CostGraphError(f"the cost graph has a cycle through {cycle}; only DAGs can be pipelined")
    if graph.number_of_nodes() == 0:
        raise CostGraphError("the cost graph is empty")
    if not copy and _complete(graph):
        return graph
    out = graph.copy()
    for name, attrs in out.nodes(data=True):
        for key, default in NODE_DEFAULTS.items():
            attrs.setdefault(key, default)
        attrs.setdefault("top_level", str(name))
        attrs.setdefault("saved_bytes", attrs["output_bytes"])
        for key in ("forward_s", "backward_s", "output_bytes", "param_bytes", "frozen_bytes", "buffer_bytes",
                    "saved_bytes"):
            if attrs[key] < 0:
                raise CostGraphError(f"node {name!r} has negative {key} = {attrs[key]}")
    if out.graph.get("saved_counted") and any("saved" not in a or "storages" not in a for _, a in out.nodes(data=True)):
        out.graph["saved_counted"] = False
    if any("order" not in attrs for _, attrs in out.nodes(data=True)):
        for i, name in enumerate(nx.lexicographical_topological_sort(out, key=str)):
            out.nodes[name]["order"] = i
    for u, _v, attrs in out.edges(data=True):
        attrs.setdefault("bytes", out.nodes[u]["output_bytes"])
    if "outputs" not in out.graph:
        out.graph["outputs"] = [n for n in ordered_nodes(out) if out.out_degree(n) == 0]
    return out


_FILLED = (*NODE_DEFAULTS, "top_level", "saved_bytes", "order")


def _complete(graph: nx.DiGraph) -> bool:
    """Whether :func:`normalize_cost_graph` would add nothing to ``graph`` (raising as it would
    on a negative cost)."""
    if "outputs" not in graph.graph:
        return False
    counted = graph.graph.get("saved_counted")
    for name, attrs in graph.nodes(data=True):
        if any(key not in attrs for key in _FILLED) or (counted and ("saved" not in attrs or "storages" not in attrs)):
            return False
        for key in ("forward_s", "backward_s", "output_bytes", "param_bytes", "frozen_bytes", "buffer_bytes",
                    "saved_bytes"):
            if attrs[key] < 0:
                raise CostGraphError(f"node {name!r} has negative {key} = {attrs[key]}")
    return all("bytes" in attrs for _, _, attrs in graph.edges(data=True))


def ordered_nodes(graph: nx.DiGraph) -> list[Any]:
    """The nodes in execution order (by their ``order`` attribute)."""
    return sorted(graph.nodes, key=lambda n: graph.nodes[n]["order"])


def node_compute(graph: nx.DiGraph, name: Any) -> float:
    """Forward plus backward seconds of one node for one micro-batch."""
    attrs = graph.nodes[name]
    return float(attrs["forward_s"] + attrs["backward_s"])


def total_compute(graph: nx.DiGraph) -> float:
    """Forward plus backward seconds of the whole model for one micro-batch."""
    return sum(node_compute(graph, n) for n in graph.nodes)


def block_of_node(attrs: dict[str, Any]) -> str | None:
    """The block (an element of a module list: a decoder layer) whose code issued the node, from
    its ``kind``, ``target`` and ``owner`` as the profiler writes them; ``None``: none."""
    path = attrs.get("target") if attrs.get("kind") == "call_module" else attrs.get("owner")
    return block_of(str(path)) if path else None


def block_param_bytes(graph: nx.DiGraph, nodes: Any) -> tuple[int, int, int]:
    """Of the parameters ``nodes`` own, the bytes of the largest block's, and of those no block
    owns: what FSDP2, sharding each block on its own, gathers at once at most, and what it keeps
    gathered for a whole step; and how many blocks own some (FSDP2 gathers each with a collective
    of its own)."""
    per_block: dict[str, int] = {}
    outside = 0
    for v in nodes:
        attrs = graph.nodes[v]
        block = block_of_node(attrs)
        if block is None:
            outside += int(attrs["param_bytes"])
        else:
            per_block[block] = per_block.get(block, 0) + int(attrs["param_bytes"])
    return max(per_block.values(), default=0), outside, sum(1 for nbytes in per_block.values() if nbytes)


def trained_tensors(graph: nx.DiGraph, nodes: Any) -> int:
    """How many parameter tensors ``nodes`` own that train (node attributes ``params`` and
    ``frozen_params``, their names; a profile without names counts none)."""
    names: set[str] = set()
    frozen: set[str] = set()
    for v in nodes:
        names.update(graph.nodes[v].get("params") or ())
        frozen.update(graph.nodes[v].get("frozen_params") or ())
    return len(names - frozen)


def cost_graph_to_dict(graph: nx.DiGraph) -> dict[str, Any]:
    """A JSON-ready dict; node names become strings."""
    graph = normalize_cost_graph(graph)
    return {
        "format": GRAPH_FORMAT,
        "graph": {k: v for k, v in graph.graph.items() if k != "format"},
        "nodes": [{"name": str(n), **graph.nodes[n]} for n in ordered_nodes(graph)],
        "edges": [[str(u), str(v), graph.edges[u, v]["bytes"]] for u, v in graph.edges],
    }


def cost_graph_from_dict(data: dict[str, Any]) -> nx.DiGraph:
    """The inverse of :func:`cost_graph_to_dict`."""
    if data.get("format") != GRAPH_FORMAT:
        raise CostGraphError(f"not a cost graph of format {GRAPH_FORMAT!r}: format={data.get('format')!r}")
    graph = nx.DiGraph()
    graph.graph.update(data["graph"])
    graph.graph["format"] = GRAPH_FORMAT
    for node in data["nodes"]:
        attrs = dict(node)
        graph.add_node(attrs.pop("name"), **attrs)
    for u, v, nbytes in data["edges"]:
        graph.add_edge(u, v, bytes=nbytes)
    return normalize_cost_graph(graph)


def save_cost_graph(graph: nx.DiGraph, path: str | os.PathLike[str]) -> None:
    """Write the cost graph as JSON, so planning can be repeated without profiling."""
    with open(path, "w") as f:
        json.dump(cost_graph_to_dict(graph), f, indent=1)


def load_cost_graph(path: str | os.PathLike[str]) -> nx.DiGraph:
    """Read a cost graph written by :func:`save_cost_graph`."""
    with open(path) as f:
        return cost_graph_from_dict(json.load(f))


def with_loss(cost: nx.DiGraph, forward_s: float, backward_s: float) -> None:
    """Charge a loss computed from the model's outputs (on the last stage, beyond the model) to
    the output that returns the most bytes, the one a loss reads (logits), so that the cut
    balances it with the rest."""
    outputs = cost.graph.get("outputs") or [n for n in cost if cost.out_degree(n) == 0]
    node = cost.nodes[max(outputs, key=lambda n: (cost.nodes[n].get("output_bytes", 0), cost.nodes[n].get("order", 0)))]
    node["forward_s"] = node.get("forward_s", 0.0) + forward_s
    node["backward_s"] = node.get("backward_s", 0.0) + backward_s


def with_times_scaled(cost: nx.DiGraph, factor: float) -> nx.DiGraph:
    """A copy of ``cost`` with every operation's forward and backward seconds times ``factor``
    (the machine's speed at another moment)."""
    scaled = cost.copy()  # each node's attributes a dict of its own
    for _, attrs in scaled.nodes(data=True):
        attrs["forward_s"] = attrs.get("forward_s", 0.0) * factor
        attrs["backward_s"] = attrs.get("backward_s", 0.0) * factor
    return scaled
