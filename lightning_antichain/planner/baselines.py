"""The baselines: contiguous splits of the execution order, costed with the same model as the DP.

* ``"uniform"``: equal operation counts;
* ``"parameters"``: balanced parameter bytes (DeepSpeed's default ``partition_method``);
* ``"blocks"``: the top-level children as blocks, balanced by time (torchgpipe's
  ``balance_by_time``), split into their own children while there are fewer blocks than stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import networkx as nx
import numpy as np

from .cost_graph import node_compute


def baseline_split(graph: nx.DiGraph, free: list[Any], stages: int, method: str) -> list[list[Any]]:
    if method == "uniform":
        return [list(part) for part in np.array_split(np.array(free, dtype=object), stages)]
    if method == "parameters":
        weights = [float(graph.nodes[v]["param_bytes"]) for v in free]
        return [[free[i] for i in part] for part in _contiguous_min_max(weights, stages)]
    blocks = _top_level_blocks(graph, free, stages)
    weights = [sum(node_compute(graph, v) for v in block) for block in blocks]
    return [[v for i in part for v in blocks[i]] for part in _contiguous_min_max(weights, stages)]


def _top_level_blocks(graph: nx.DiGraph, free: list[Any], stages: int) -> list[list[Any]]:
    """Runs of consecutive operations with the same top-level owner; split deeper while too few."""
    depth = 1
    while True:
        blocks: list[list[Any]] = []
        key = None
        for v in free:
            owner = graph.nodes[v].get("owner") or ""
            parts = owner.split(".") if owner else [str(v)]
            this = ".".join(parts[:depth]) if owner else str(v)
            if blocks and this == key:
                blocks[-1].append(v)
            else:
                blocks.append([v])
                key = this
        deepest = max((len((graph.nodes[v].get("owner") or "").split(".")) for v in free), default=1)
        if len(blocks) >= stages or depth > deepest:
            if len(blocks) < stages:
                return [[v] for v in free]
            return blocks
        depth += 1


def _contiguous_min_max(weights: Sequence[float], parts: int) -> list[range]:
    """Split a sequence into ``parts`` non-empty runs minimising the heaviest run (exact DP)."""
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((parts + 1, n + 1), np.inf)
    back = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            options = np.maximum(best[k - 1, :j], prefix[j] - prefix[:j])
            i = int(options.argmin())
            best[k, j], back[k, j] = options[i], i
    bounds, j = [n], n
    for k in range(parts, 0, -1):
        j = int(back[k, j])
        bounds.append(j)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]
