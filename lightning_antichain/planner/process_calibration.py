"""A plan's stage times as the process runtime takes them, read from a few of its steps.

The profile predicts a step of stages as processes from operations replayed one micro-batch at a
time. On a shared 2-core machine the measured steps were 1.18 to 2.06 times that prediction, by
schedule: what an action of torch's schedule costs beyond its operations (posting its sends, the
loss, torch's books), a GPipe backward reading activations made long before, and a zero-bubble
backward whose two halves cost more than one whole. Each rank times its actions in the steps it
runs (:class:`~lightning_antichain.measure.action_clock.ActionClock`); their costs, gathered, become
the plan's stage times, and the timeline of the schedule's tasks then predicts the step
(docs/benchmark-runs.md, "Stages as processes on CPU"). The cut is untouched: only the times change.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from ..device import synchronize
from ..measure.action_clock import ActionClock, ActionKey
from ..plans.plan import Plan
from ..plans.schedule import Schedule
from ..plans.step_prediction import recomputed_micro_batches

#: steps of the process runtime timed before its plan's times are taken from them (after the first,
#: in which torch's stages learn their shapes)
CALIBRATION_STEPS = 3


def process_calibrated(plan: Plan, steps: Sequence[Mapping[ActionKey, float]], lengths: Sequence[float],
                       schedule: Schedule) -> Plan:
    """``plan`` with each stage's times taken from the timed ``steps`` (per step, each action's
    cost per micro-batch by phase and stage, every rank's; the median over the steps), which
    already hold what the runtime adds to a task and the slowdown of ranks that share the CPU; its
    step predicted again under ``schedule`` (torch's table of tasks). What the timeline of a
    step's actions leaves unexplained of its length (``lengths``: the slowest rank's) is the
    runtime's cost per step, the median over the steps: a step slowed throughout by a busy machine
    raises both and cancels. ``plan.calibration`` keeps the profiled times and prediction, the
    median step measured and the part of it the timeline explains."""
    if not steps or len(steps) != len(lengths):
        raise ValueError(f"{len(steps)} timed steps of actions and {len(lengths)} step lengths: time whole steps")
    keys = {key for step in steps for key in step}
    costs = {key: statistics.median(step[key] for step in steps if key in step) for key in keys}
    record: dict[str, Any] = {
        "runtime": "processes", "schedule": schedule.name, "steps": len(steps),
        "measured_step_s": statistics.median(lengths), "profiled_step_s": plan.predict_step(schedule),
        "profiled_forward_s": [s.forward_s for s in plan.stages],
        "profiled_backward_s": [s.backward_s for s in plan.stages],
    }
    new = _timed_as(plan, costs, record)
    record["explained_step_s"] = _explained(new, schedule)
    # what the timeline of the actions leaves unexplained of a step (a rank ready to run while the
    # cores are busy with others; torch's work before the first action and after the last)
    unexplained = [length - _explained(_timed_as(plan, step, record), schedule) for step, length in zip(steps, lengths)]
    new = replace(new, step_overhead_s=max(0.0, statistics.median(unexplained)))
    return replace(new, predicted_step_s=new.predict_step(schedule))


def _timed_as(plan: Plan, costs: Mapping[ActionKey, float], record: dict[str, Any]) -> Plan:
    """``plan`` with its stage times from ``costs`` (the task overhead and transfers it charges
    taken out, so its timeline gives each task its cost back), no per-step cost, and ``record`` as
    its calibration."""
    missing = [k for k in range(plan.num_stages) if ("forward", k) not in costs]
    if missing:
        raise ValueError(f"no forward was timed on stage(s) {missing}: gather every rank's action costs")
    again = 1.0 if recomputed_micro_batches(plan.recompute, plan.chunks) >= plan.chunks else 0.0
    # a cost is the mean over a step's micro-batches, whose backwards but the first add their
    # gradients into those already there (Plan.durations)
    adding = (plan.chunks - 1) / plan.chunks
    stages = []
    for stage in plan.stages:
        k, overhead, half = stage.index, plan.task_overhead_s, stage.transfer_s / 2
        forward = max(0.0, costs["forward", k] - overhead - half)
        recomputed = again * forward  # a recomputing stage's backward runs its forward again
        accumulated = adding * plan.prediction.accumulation_s(stage)
        if ("backward", k) in costs:
            backward = max(0.0, costs["backward", k] - overhead - half - recomputed - accumulated)
            stages.append(replace(stage, forward_s=forward, backward_s=backward, backward_input_s=None,
                                  backward_weight_s=None))
            continue
        input_s = max(0.0, costs.get(("backward_input", k), 0.0) - overhead - half - recomputed)
        weight_s = max(0.0, costs.get(("backward_weight", k), 0.0) - overhead - accumulated)
        stages.append(replace(stage, forward_s=forward, backward_s=input_s + weight_s, backward_input_s=input_s,
                              backward_weight_s=weight_s))
    return replace(plan, stages=stages, bottleneck_s=max(s.time_s for s in stages),
                   total_compute_s=sum(s.compute_s for s in stages), step_overhead_s=0.0, calibration=record)


def _explained(plan: Plan, schedule: Schedule) -> float:
    return max(t.end for t in plan.timeline(schedule))


class StepCalibration:
    """The first training steps of a rank, timed: the first untouched (torch's stages learn their
    shapes in it), the next ``steps`` with their actions timed (:class:`ActionClock`) and their
    length measured."""

    def __init__(self, steps: int = CALIBRATION_STEPS) -> None:
        self.wanted = steps
        self.clock: ActionClock | None = None
        self.seen = 0
        self.lengths: list[float] = []

    @property
    def done(self) -> bool:
        return len(self.lengths) >= self.wanted

    @contextmanager
    def timing(self, device: torch.device) -> Iterator[ActionClock | None]:
        """One training step on ``device``: the clock to time its actions with, or ``None`` for the first."""
        self.seen += 1
        if self.seen == 1 or self.done:
            yield None
            return
        self.clock = self.clock or ActionClock(device)
        synchronize(device)
        started = time.perf_counter()
        yield self.clock
        synchronize(device)
        self.lengths.append(time.perf_counter() - started)

    def record(self) -> RankRecord:
        """What this rank measured, to gather from every rank: its action costs and step lengths."""
        return ([] if self.clock is None else self.clock.steps), self.lengths


RankRecord = tuple[list[dict[ActionKey, float]], list[float]]
"""What a rank measured over the timed steps: per step, its actions' costs; and the steps' lengths."""


def from_records(plan: Plan, schedule: Schedule, records: Sequence[RankRecord]) -> Plan:
    """``plan`` with its times from every rank's ``records`` (:func:`process_calibrated`): per
    timed step, every rank's action costs and the slowest rank's length."""
    count = min(len(lengths) for _, lengths in records)
    steps = [{key: cost for costs, _ in records for key, cost in costs[i].items()} for i in range(count)]
    return process_calibrated(plan, steps, [max(lengths[i] for _, lengths in records) for i in range(count)],
                              schedule)
