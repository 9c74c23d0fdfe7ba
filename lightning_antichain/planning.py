"""From a model and one micro-batch to a plan: the one path the strategy and the CLI both take.

Capture, check that micro-batching keeps each sample's result, profile (or read the profile
cache), then partition over the devices with the same device defaults everywhere: links between
GPUs at 16 GB/s and 90% of each GPU's memory, free transfers and no memory limit between CPU
devices, unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn

from .batch_dims import check_micro_batchable
from .capture import OpGraph, UntraceableModelError, capture_call
from .memory import device_memory_gb
from .partition import partition, plan_from_balance
from .plan import Plan
from .profile_cache import cache_file, default_cache_dir, load_cached, profile_key, store
from .profiler import profile
from .trace import children_instead

GPU_LINK_GBPS = 16.0
"""Bandwidth assumed between GPU stages when none is given: PCIe 4.0 x16 in one direction."""


@dataclass
class Planned:
    """A plan with the captured graph it cuts (``None`` for a profile loaded from a file), the cost
    graph it was made from, and the cache file that cost graph was read from, if it was."""

    plan: Plan
    graph: OpGraph | None
    cost: nx.DiGraph
    cached_from: Path | None = None


def default_bandwidth_gbps(devices: Sequence[torch.device]) -> float | None:
    """Bandwidth between stages: :data:`GPU_LINK_GBPS` where a stage is on a GPU, else free."""
    return GPU_LINK_GBPS if any(d.type == "cuda" for d in devices) else None


def default_memory_gb(devices: Sequence[torch.device]) -> list[float | None]:
    """Memory per stage: 90% of each GPU's, unlimited on CPU."""
    return [device_memory_gb(d) for d in devices]


def plan_model(
    module: nn.Module | None,
    args: tuple,
    kwargs: dict,
    devices: Sequence[str | torch.device],
    *,
    chunks: int,
    balance: Sequence[int] | None = None,
    method: str = "antichain",
    batch_dim: int | Mapping[str, int] = 0,
    check_batch: bool = True,
    leaf_modules: Sequence[type | str] = (),
    bandwidth_gbps: float | None = None,
    memory_gb: float | Sequence[float | None] | None = None,
    optimizer_multiplier: float = 2.0,
    fallback: str | None = None,
    profile_cache: str | Path | None = None,
    use_profile_cache: bool = True,
    progress: bool = True,
    name: str | None = None,
    cost: nx.DiGraph | None = None,
) -> Planned:
    """Plan ``module`` over ``devices`` (one stage each) for micro-batches like ``args, kwargs``.

    The module is captured on the micro-batch and checked (``check_batch``, see
    :func:`~lightning_antichain.batch_dims.check_micro_batchable`); its profile is read from
    ``profile_cache`` (default ``~/.cache/lightning-antichain``) where a valid entry exists, else
    measured on ``devices[0]`` and stored. ``cost`` skips all that and plans a saved cost graph.
    ``balance`` fixes the operations per stage instead of planning. ``fallback="children"`` plans
    a model no frontend can capture at its top-level children (for a look at the plan only: such a
    plan cannot run). ``bandwidth_gbps`` and ``memory_gb`` default to
    :func:`default_bandwidth_gbps` and :func:`default_memory_gb`.
    """
    devices = [torch.device(d) for d in devices]
    graph = None
    cached_from = None
    if cost is None:
        if module is None:
            raise ValueError("plan_model needs a module to profile, or a cost graph (cost=)")
        graph = _capture(module, args, kwargs, leaf_modules, batch_dim, fallback, progress)
        if check_batch and graph.granularity == "ops":
            check_micro_batchable(module, args, kwargs, batch_dim)
        directory = Path(profile_cache) if profile_cache else default_cache_dir()
        key = profile_key(graph, module, (args, kwargs), devices[0])
        cost = load_cached(directory, key, graph) if use_profile_cache else None
        if cost is not None:
            cached_from = cache_file(directory, key)
        else:
            example: Any = kwargs if kwargs else args
            cost = profile(module, example, devices[0], op_graph=graph, name=name or type(module).__name__,
                           batch_dim=batch_dim, progress=progress)
            if use_profile_cache:
                store(directory, key, cost)
    names = [str(d) for d in devices]
    bandwidth = bandwidth_gbps if bandwidth_gbps is not None else default_bandwidth_gbps(devices)
    if balance is not None:
        plan = plan_from_balance(cost, list(balance), chunks=chunks, devices=names, bandwidth_gbps=bandwidth,
                                 optimizer_multiplier=optimizer_multiplier)
    else:
        memory = memory_gb if memory_gb is not None else default_memory_gb(devices)
        plan = partition(cost, len(devices), chunks=chunks, method=method, devices=names, bandwidth_gbps=bandwidth,
                         memory_gb=memory, optimizer_multiplier=optimizer_multiplier)
    return Planned(plan, graph, cost, cached_from)


def _capture(module: nn.Module, args: tuple, kwargs: dict, leaf_modules: Sequence[type | str],
             batch_dim: int | Mapping[str, int], fallback: str | None, progress: bool) -> OpGraph:
    try:
        return capture_call(module, args, kwargs, leaf_modules=leaf_modules, progress=progress, batch_dim=batch_dim)
    except UntraceableModelError as exc:
        if fallback != "children":
            raise
        return children_instead(module, kwargs if kwargs else args, exc)
