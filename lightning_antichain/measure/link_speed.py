"""How fast the ranks' process group runs each kind of collective, measured: the planner's links
between CPU processes, where nothing better is known.

Between CPU processes, gloo copies every message through the host's network stack: a transfer is
not free, and reducing a large model's gradients over replicas can cost as much as its backward.
A collective also costs a time whatever its bytes: between processes sharing a CPU's cores,
milliseconds (every rank must be scheduled to meet the others), which FSDP2 pays twice per block
per step. And gloo's kinds differ: its all-gather and reduce-scatter move bytes at other speeds
than its all-reduce. So every rank runs each kind DDP and FSDP2 use back to back, as a step does,
at two sizes, and the latency and the bandwidth follow from the line through the two times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

PROBE_BYTES = 8 * 2**20
"""The large probe: big enough that bytes, not the latency, set its time."""
SMALL_BYTES = 64 * 2**10
"""The small probe: a collective's fixed cost, at the size of a small block's gather."""

Kind = Literal["all_reduce", "all_gather", "reduce_scatter"]
KINDS: tuple[Kind, ...] = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class CollectiveSpeed:
    """One kind of collective on a group: what it costs whatever its bytes, and the bytes a rank
    sends in a ring per second beyond that."""

    latency_s: float
    gbps: float


def ring_sent_bytes(kind: Kind, nbytes: float, ranks: int) -> float:
    """The bytes each rank sends in a ring ``kind`` of ``nbytes`` (the whole tensor: the all-reduced
    one, the all-gather's output, the reduce-scatter's input)."""
    share = (ranks - 1) / ranks * nbytes
    return 2.0 * share if kind == "all_reduce" else share


def measured_collectives(device: torch.device, group: Any = None, repeats: int = 5) -> dict[Kind, CollectiveSpeed]:
    """Each kind's latency and bandwidth over ``group`` (every rank calls it and gets the same
    values: the slowest rank's times)."""
    ranks = dist.get_world_size(group)
    speeds = {}
    for kind in KINDS:
        small, large = (_back_to_back_s(kind, nbytes, device, group, repeats) for nbytes in (SMALL_BYTES, PROBE_BYTES))
        sent_small, sent_large = (ring_sent_bytes(kind, n, ranks) for n in (SMALL_BYTES, PROBE_BYTES))
        if large > small:
            gbps = (sent_large - sent_small) / (large - small) / 1e9
            latency = max(0.0, small - sent_small / (gbps * 1e9))
        else:  # a busy machine's noise swamped the bytes: charge the large probe's pace, and the small one's time
            gbps, latency = sent_large / large / 1e9, small
        speeds[kind] = CollectiveSpeed(latency, gbps)
    return speeds


def _back_to_back_s(kind: Kind, nbytes: int, device: torch.device, group: Any, repeats: int) -> float:
    """Seconds a ``kind`` of ``nbytes`` takes run ``repeats`` times in a row after a barrier (the
    slowest rank's mean; the median of three such runs, after one to warm up)."""
    op = _collective(kind, nbytes, device, group)
    runs = []
    for i in range(4):
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(repeats):
            op()
        elapsed = torch.tensor([(time.perf_counter() - started) / repeats], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i:
            runs.append(float(elapsed))
    return statistics.median(runs)


def _collective(kind: Kind, nbytes: int, device: torch.device, group: Any) -> Callable[[], None]:
    ranks = dist.get_world_size(group)
    whole = torch.zeros(max(nbytes // 4 // ranks, 1) * ranks, dtype=torch.float32, device=device)
    shard = torch.zeros(whole.numel() // ranks, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, shard, group=group)
    return lambda: dist.reduce_scatter_tensor(shard, whole, group=group)
