"""The ranks of a benchmark on one machine: a process per rank, started fresh, each putting its rows
on a queue; the one launcher every benchmark of processes uses.

    rows = run_ranks(rank_main, 4, args, expected=4)   # rank_main(rank, ranks, port, args, results)

A rank that fails ends the run: every process is killed, and its error is the one printed.
"""

from __future__ import annotations

import os
import queue
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now, for the ranks to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., None], ranks: int, *args: Any, expected: int) -> list[Any]:
    """Start ``ranks`` fresh processes (spawned), rank ``r`` running
    ``target(r, ranks, port, *args, results)``, and return the ``expected`` rows they put on
    ``results``, once every process has ended."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(r, ranks, port, *args, results)) for r in range(ranks)]
    for process in processes:
        process.start()
    return collected(processes, results, expected)


def collected(processes: list, results: Any, expected: int) -> list[Any]:
    """The ``expected`` rows the ranks put on ``results``, once every process has ended; where a
    rank fails, every process is killed and the run stops."""
    rows = []
    while len(rows) < expected:
        try:
            rows.append(results.get(timeout=5))
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                for process in processes:
                    process.kill()
                raise SystemExit(f"a rank failed (exit codes {failed}); its error is printed above") from None
    for process in processes:
        process.join(timeout=60)
    return rows


def join_group(rank: int, ranks: int, port: int, backend: str = "gloo", **environment: str) -> None:
    """Join the ranks' default process group at ``port`` of 127.0.0.1 (``environment``: more
    variables to set first, as a launcher would)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **environment)
    dist.init_process_group(backend, rank=rank, world_size=ranks)
