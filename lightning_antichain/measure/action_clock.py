"""What each of a rank's actions costs under torch's schedule, read from the steps it runs.

A profiled stage time replays the stage's operations one micro-batch at a time. An action of torch's
schedule does more: it posts its sends, computes the micro-batch's loss on the last stage and keeps
torch's books, and its cost depends on the schedule around it (a GPipe backward reads activations
made long before, a zero-bubble schedule's two halves of a backward cost more than one whole). So the
clock times, on each rank, what the rank itself does from the start of one action to the start of
the next, less what it spends waiting for a message, and charges it to the first action. That is
each task's duration for the planner's timeline
(:func:`~lightning_antichain.plans.schedule.timeline`): the waits are what
the timeline makes of the dependencies between ranks.

The waits are read from torch's own helper that every schedule waits through
(``torch.distributed.pipelining.schedules._wait_batch_p2p``), replaced only while a timed step runs.
On an accelerator each mark waits for the device, so the timed steps run a little slower than the
others.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..device import is_accelerator, synchronize
from ..plans.schedule import Phase
from ..torch_private import batch_waits_through

#: torch's stage method -> the phase it runs (a backward without the weights' half: see _phase)
_METHODS: dict[str, Phase] = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
                              "backward_weight_one_chunk": "backward_weight"}

ActionKey = tuple[Phase, int]
"""An action's phase and the index of the stage that runs it."""


class ActionClock:
    """Each action's cost on this rank, per timed step: for every (phase, stage), the mean over the
    step's micro-batches (:attr:`steps`, one dict per timed step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[ActionKey, float]] = []

    @contextmanager
    def timing(self, stages: list[Any]) -> Iterator[None]:
        """Time the actions of ``stages`` (torch's ``PipelineStage`` objects of this rank) during
        the step run inside the block."""
        marks: list[tuple[ActionKey | None, float, float]] = []  # key (None: a wait), start, end
        on_device = is_accelerator(self.device)

        def now() -> float:
            if on_device:
                synchronize(self.device)
            return time.perf_counter()

        def timed_wait(waited: Any) -> Any:
            def wait(works: Any) -> Any:
                started = now()
                try:
                    return waited(works)
                finally:
                    marks.append((None, started, now()))
            return wait

        def timed(method: Any, name: str, index: int) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                started = now()
                try:
                    return method(*args, **kwargs)
                finally:
                    marks.append(((_phase(name, kwargs), index), started, now()))
            return run

        for stage in stages:
            for name in _METHODS:
                setattr(stage, name, timed(getattr(stage, name), name, stage.stage_index))
        try:
            with batch_waits_through(timed_wait):
                yield
                ended = now()
        finally:
            for stage in stages:
                for name in _METHODS:
                    vars(stage).pop(name, None)
        self.steps.append(_costs(marks, ended))


def _phase(method: str, kwargs: dict[str, Any]) -> Phase:
    if method == "backward_one_chunk" and not kwargs.get("full_backward", True):
        return "backward_input"
    return _METHODS[method]


def _costs(marks: list[tuple[ActionKey | None, float, float]], ended: float) -> dict[ActionKey, float]:
    """Each action's cost: from its start to the next action's start or the step's end, less the
    waits in between; the mean per (phase, stage)."""
    costs: dict[ActionKey, list[float]] = defaultdict(list)
    current: ActionKey | None = None
    last = 0.0
    for key, start, end in [*marks, (None, ended, ended)]:
        if current is not None:
            costs[current][-1] += start - last
        last = end
        if key is not None:
            costs[key].append(end - start)
            current = key
    return {key: statistics.fmean(values) for key, values in costs.items()}
