"""How fast the ranks' process group runs each kind of collective, measured: the planner's links
between CPU processes, where nothing better is known.

Between CPU processes, gloo copies every message through the host's network stack: a transfer is
not free, and reducing a large model's gradients over replicas can cost as much as its backward.
A collective also costs a time whatever its bytes: between processes sharing a CPU's cores,
milliseconds (every rank must be scheduled to meet the others), which FSDP2 pays twice per block
per step, and a pipeline once per value it sends to the next rank. And gloo's kinds differ: its
all-gather and reduce-scatter move bytes at other speeds than its all-reduce. So every rank runs
each kind DDP, FSDP2 and the pipeline's sends use back to back at two sizes, and the bandwidth
follows from the line through the two times. The all-reduce is timed as DDP runs it, with the
gradients copied into its bucket and back (on 4 processes sharing 2 cores, the copies of 100 MB
took 50 ms beside the all-reduce's 170-190). The latency is timed as a step meets it: each
small collective after a few milliseconds of work, whose own time (all ranks working at once) is
taken out. Where processes outnumber the cores, a rank then waits for others the scheduler has
set aside: 7-10 ms a collective on a 2-core machine with 4 processes, twice what back-to-back
collectives show.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

PROBE_BYTES = 25 * 2**20
"""The large probe: DDP's default bucket, the size replicas reduce gradients at, where bytes, not
the latency, set the time. At 8 MiB the line through the two probes swung 2x from call to call
with the small probe's scheduling noise (a 100 MB all-reduce predicted at 99-218 ms where it took
155-190 ms between 4 processes on 2 cores); at 25 MiB, 138-206."""
SMALL_BYTES = 64 * 2**10
"""The small probe: a collective's fixed cost, at the size of a small block's gather."""

WORK_MATMULS = 8
"""The work before each collective of the latency probe: products of 256 x 256 matrices, a few
milliseconds on a CPU core (a block's forward, say)."""

Kind = Literal["all_reduce", "all_gather", "reduce_scatter", "send"]
KINDS: tuple[Kind, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")


@dataclass(frozen=True)
class CollectiveSpeed:
    """One kind of collective on a group: what it costs whatever its bytes, and the bytes a rank
    sends in a ring per second beyond that."""

    latency_s: float
    gbps: float


def ring_sent_bytes(kind: Kind, nbytes: float, ranks: int) -> float:
    """The bytes each rank sends in a ring ``kind`` of ``nbytes`` (the whole tensor: the all-reduced
    one, the all-gather's output, the reduce-scatter's input, the one sent)."""
    if kind == "send":
        return float(nbytes)
    share = (ranks - 1) / ranks * nbytes
    return 2.0 * share if kind == "all_reduce" else share


def measured_collectives(device: torch.device, group: Any = None, repeats: int = 5) -> dict[Kind, CollectiveSpeed]:
    """Each kind's latency and bandwidth over ``group`` (every rank calls it and gets the same
    values: the slowest rank's times)."""
    ranks = dist.get_world_size(group)
    speeds = {}
    for kind in KINDS:
        small, large = (_back_to_back_s(kind, nbytes, device, group, count)
                        for nbytes, count in ((SMALL_BYTES, repeats), (PROBE_BYTES, max(1, repeats // 2))))
        sent_small, sent_large = (ring_sent_bytes(kind, n, ranks) for n in (SMALL_BYTES, PROBE_BYTES))
        if large > small:
            gbps = (sent_large - sent_small) / (large - small) / 1e9
        else:  # a busy machine's noise swamped the bytes: charge the large probe's pace
            gbps = sent_large / large / 1e9
        between_work = _after_work_s(kind, device, group, repeats)
        speeds[kind] = CollectiveSpeed(max(0.0, between_work - sent_small / (gbps * 1e9)), gbps)
    return speeds


def _after_work_s(kind: Kind, device: torch.device, group: Any, repeats: int) -> float:
    """What a small ``kind`` adds to a step when each follows some work on every rank: the
    slowest rank's time for ``repeats`` rounds of work and collective, less its time for the work
    alone (the median of three such pairs, after one to warm up)."""
    op = _collective(kind, SMALL_BYTES, device, group)
    work = torch.randn(256, 256, device=device)

    def busy() -> None:
        for _ in range(WORK_MATMULS):
            work @ work

    extra = []
    for i in range(4):
        times = []
        for with_collective in (False, True):
            dist.barrier(group=group)
            started = time.perf_counter()
            for _ in range(repeats):
                busy()
                if with_collective:
                    op()
            times.append(time.perf_counter() - started)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        if i:
            extra.append(float(slowest[1] - slowest[0]) / repeats)
    return max(0.0, statistics.median(extra)) / (2 if kind == "send" else 1)


def _back_to_back_s(kind: Kind, nbytes: int, device: torch.device, group: Any, repeats: int) -> float:
    """Seconds a ``kind`` of ``nbytes`` takes run ``repeats`` times in a row after a barrier (the
    slowest rank's mean; the median of three such runs, after one to warm up). A send is timed as
    half a round trip between neighbouring ranks (0 and 1, 2 and 3, ...)."""
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
    return statistics.median(runs) / (2 if kind == "send" else 1)


def _collective(kind: Kind, nbytes: int, device: torch.device, group: Any) -> Callable[[], None]:
    ranks = dist.get_world_size(group)
    whole = torch.zeros(max(nbytes // 4 // ranks, 1) * ranks, dtype=torch.float32, device=device)
    shard = torch.zeros(whole.numel() // ranks, dtype=torch.float32, device=device)
    if kind == "all_reduce":  # as DDP runs it: the gradients copied into its bucket and back out
        gradients = torch.zeros_like(whole)

        def bucketed() -> None:
            whole.copy_(gradients)
            dist.all_reduce(whole, group=group)
            gradients.copy_(whole)

        return bucketed
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.14
        return lambda: gather(whole, shard, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, whole, group=group)
    rank = dist.get_rank(group)
    peer = rank ^ 1
    if peer >= ranks:  # the odd rank out has no neighbour
        return lambda: None
    peer = dist.get_global_rank(group, peer) if group is not None else peer
    sent = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)

    def round_trip() -> None:
        for first in (rank % 2 == 0, rank % 2 == 1):
            (dist.send if first else dist.recv)(sent, peer, group=group)

    return round_trip
