"""Seconds of the ring collectives NCCL and gloo run, from their bytes, the ranks and the links."""

from __future__ import annotations


def ring_all_reduce_s(nbytes: float, ranks: int, gbps: float | None, latency_s: float = 0.0) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks on links of ``gbps``, one
    collective of ``latency_s``."""
    if ranks <= 1 or gbps is None or nbytes <= 0:
        return 0.0
    return 2.0 * ring_all_gather_s(nbytes, ranks, gbps) + latency_s


def ring_all_gather_s(nbytes: float, ranks: int, gbps: float | None) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) of ``nbytes`` in all over ``ranks`` ranks
    on links of ``gbps``: each rank sends and receives all but its own share."""
    if ranks <= 1 or gbps is None or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (gbps * 1e9)
