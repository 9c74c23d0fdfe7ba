"""How many intra-op threads a stage on the CPU computes with, and profiling with the same count.

CPU stages share the machine's cores. Each one running with the process's thread count (all the
cores, by default) oversubscribes them as soon as two stages overlap, and a profile taken with
that count times operations faster than a stage that shares its cores ever runs them. So each CPU
stage gets its share of the cores, and planning profiles and calibrates with that same count,
whatever the caller's own is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch

from ..device import shares_host


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def stage_threads(devices: Iterable[str | torch.device], requested: int | None = None) -> int | None:
    """The intra-op threads of each stage on the CPU among ``devices``: ``requested``, else the
    cores shared evenly among them (at least one). ``None`` where no stage runs on the CPU."""
    on_cpu = sum(shares_host(torch.device(d)) for d in devices)
    if not on_cpu:
        return None
    return requested if requested is not None else max(1, cpu_cores() // on_cpu)


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """The calling thread computes with ``count`` intra-op threads inside the block (``None``: as it was)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
