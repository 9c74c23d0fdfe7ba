"""A disk cache of cost graphs, so a rerun with the same model and shapes skips profiling.

The key covers everything that changes the measurements: the cache format, the traced graph's code, every parameter
and buffer's name, shape and dtype, the example inputs' shapes and dtypes, the device's name, the
autocast dtype, and the torch version. Weights' values do not change costs and are not part of it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn

from .graph import load_cost_graph, save_cost_graph
from .trace import OpGraph, iter_tensors

# Bumped whenever what the profiler records changes, so older entries are profiled again.
CACHE_VERSION = 2


def default_cache_dir() -> Path:
    """``$LIGHTNING_ANTICHAIN_CACHE``, else ``~/.cache/lightning-antichain``."""
    root = os.environ.get("LIGHTNING_ANTICHAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lightning-antichain"


def profile_key(graph: OpGraph, module: nn.Module, example: Any, device: torch.device) -> str:
    """A stable hash of what the costs of ``module`` on ``example`` at ``device`` depend on."""
    digest = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    code = graph.graph_module.code if graph.graph_module is not None else repr([n.name for n in graph.nodes])
    digest.update(code.encode())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    for tensor in iter_tensors(example):
        digest.update(f"in:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    autocast = [str(torch.get_autocast_dtype(k)) for k in ("cpu", "cuda") if torch.is_autocast_enabled(k)]
    digest.update(f"{name}|{autocast}|{torch.__version__}".encode())
    return digest.hexdigest()[:32]


def load_cached(directory: Path, key: str) -> nx.DiGraph | None:
    path = directory / f"{key}.json"
    if not path.exists():
        return None
    try:
        return load_cost_graph(path)
    except (ValueError, KeyError, OSError):
        return None  # a damaged or old cache entry is profiled again


def store(directory: Path, key: str, graph: nx.DiGraph) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    tmp = path.with_suffix(".tmp")
    save_cost_graph(graph, tmp)
    tmp.replace(path)
    return path
