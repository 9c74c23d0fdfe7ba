"""Evidence that a pipeline really ran, for tests that claim parity with plain training.

Parity alone would also hold if the strategy planned and then called the plain module; these
checks fail then: the work must have been done by the pipeline's own worker threads, spread over
more than one stage and more than one thread.
"""

from __future__ import annotations

import threading
from collections import Counter

import lightning as L

import lightning_antichain as la


def tasks_of(ran: la.Pipeline | L.Trainer | la.AntichainPipelineStrategy | Counter) -> Counter:
    if isinstance(ran, L.Trainer):
        ran = ran.strategy
    if isinstance(ran, (la.Pipeline, la.AntichainPipelineStrategy)):
        ran = ran.tasks_run
    return Counter(ran)


def assert_pipelined(ran: la.Pipeline | L.Trainer | la.AntichainPipelineStrategy | Counter,
                     since: Counter | None = None, stages: int = 2) -> Counter:
    """At least ``stages`` stages ran tasks, on as many worker threads, and none on this thread;
    ``since`` (an earlier :func:`tasks_of`) leaves out what ran before it. Returns the tasks."""
    tasks = tasks_of(ran) - (since or Counter())
    ran_stages = {stage for stage, _ in tasks}
    threads = {thread for _, thread in tasks}
    assert ran_stages and len(ran_stages) >= stages, (
        f"tasks ran on stages {sorted(ran_stages)} only: the pipeline did not run")
    assert len(threads) >= stages, f"all tasks ran on {len(threads)} thread: the stages were not run by their workers"
    assert threading.get_ident() not in threads, "stage tasks ran on the calling thread"
    return tasks
