"""``layout_trials=``: how long the ranks time the layouts in turns before choosing one.

A lead smaller than the steps' noise (the quickest winning only some turns) keeps them timing, up to
``MOST_TRIAL_STEPS`` turns; a lead every turn agrees on stops them after ``TRIAL_STEPS``. Every rank
takes the same decision. The trials in a real fit: tests/test_stage_processes_trainer.py.
"""

from __future__ import annotations

import os
import queue
import time

import pytest
import torch
import torch.distributed as dist
from launch import free_port, process_context

from lightning_antichain.processes.layout_trials import MOST_TRIAL_STEPS, TRIAL_STEPS, Turns, timed_in_turns


def test_the_quickest_wins_clearly_only_where_it_beats_every_other_layout_in_most_turns():
    clear = Turns([[1.0, 1.1, 0.9, 1.0, 1.2], [1.3, 1.2, 1.4, 0.95, 1.3], [2.0, 2.1, 1.9, 2.0, 2.0]])
    assert clear.quickest == 0 and clear.wins(1) == 4 and clear.wins(2) == 5 and clear.clear
    # a lower median, but the turns split: the second layout was quicker in 2 of 5
    close = Turns([[1.0, 1.1, 0.9, 1.0, 1.2], [1.05, 1.05, 0.95, 0.98, 1.25]])
    assert close.quickest == 0 and close.medians == [1.0, 1.05] and close.wins(1) == 3 and not close.clear
    assert Turns([[1.0] * 5]).clear  # one layout: nothing to settle


def sleeping_turns(rank: int, port: int, sleeps: list[list[float]], results) -> None:
    """Times layouts whose step in turn ``r`` sleeps ``sleeps[i][r % len]`` seconds on this rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        calls = [0] * len(sleeps)

        def step(i: int):
            def run() -> None:
                time.sleep(sleeps[i][calls[i] % len(sleeps[i])] if rank == 1 else 0.001)
                calls[i] += 1
            return run

        turns = timed_in_turns([step(i) for i in range(len(sleeps))], torch.device("cpu"))
        results.put((rank, turns.count, turns.quickest, turns.medians))
    finally:
        dist.destroy_process_group()


def turns_on_two_ranks(sleeps: list[list[float]]) -> list[tuple]:
    context = process_context()
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=sleeping_turns, args=(r, port, sleeps, results)) for r in range(2)]
    for process in processes:
        process.start()
    try:
        reports = sorted(results.get(timeout=120) for _ in processes)
    except queue.Empty:
        pytest.fail("the ranks gave no result within 120 s")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(p.exitcode == 0 for p in processes)
    return reports


@pytest.mark.processes
def test_the_ranks_time_close_layouts_for_more_turns_and_all_take_the_same_one():
    # the slow rank (1) sets each turn's time; the first call of each step is the untimed one
    clear = turns_on_two_ranks([[0.01], [0.05]])
    assert [r[1:3] for r in clear] == [(TRIAL_STEPS, 0)] * 2
    assert clear[0][3][1] > 0.04  # rank 1's sleep, timed on rank 0 too: the turn ends when every rank is done
    # each layout quicker in every other turn: no turn count settles it, so the most are taken
    split = turns_on_two_ranks([[0.01, 0.04], [0.04, 0.01]])
    assert [r[1] for r in split] == [MOST_TRIAL_STEPS] * 2 and split[0][2:] == split[1][2:]
