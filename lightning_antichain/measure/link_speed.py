"""How fast the ranks' process group moves bytes, measured: the planner's link between CPU
processes, where nothing better is known.

Between CPU processes, gloo copies every message through the host's network stack: a transfer is
not free, and reducing a large model's gradients over replicas can cost as much as its backward.
Every rank times a few all-reduces of one buffer, and the bandwidth follows from what a ring
all-reduce sends (twice the bytes, less one share). A collective also costs a time whatever its bytes:
between processes sharing a CPU's cores, milliseconds (every rank must be scheduled to meet the
others), which FSDP2 pays twice per block per step. An all-reduce of one number measures it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

PROBE_BYTES = 8 * 2**20


def measured_gbps(device: torch.device, group: Any = None, nbytes: int = PROBE_BYTES, repeats: int = 3) -> float:
    """The bandwidth in GB/s of an all-reduce of ``nbytes`` over ``group`` (every rank calls it;
    each gets the same value: the slowest rank's time, median of ``repeats`` after one to warm up)."""
    ranks = dist.get_world_size(group)
    seconds = _all_reduce_s(device, group, nbytes, repeats)
    sent = 2.0 * (ranks - 1) / ranks * nbytes if ranks > 1 else float(nbytes)
    return sent / max(seconds, 1e-9) / 1e9


def measured_latency_s(device: torch.device, group: Any = None, repeats: int = 5) -> float:
    """Seconds of an all-reduce of one number over ``group``: what any collective costs there
    whatever its bytes (every rank calls it and gets the same value)."""
    return _all_reduce_s(device, group, 4, repeats)


def _all_reduce_s(device: torch.device, group: Any, nbytes: int, repeats: int) -> float:
    """The slowest rank's seconds of an all-reduce of ``nbytes``, median of ``repeats`` after one
    to warm up, each after a barrier."""
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        started = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i:
            times.append(float(elapsed))
    return statistics.median(times)
