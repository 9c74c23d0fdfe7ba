"""What a plan predicts of one training step: each task's seconds, when each task runs, and how
long the step takes, kept apart from the plan itself (which is the cut and its costs, as data).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..device import shares_host
from .schedule import GRADIENT_OUT, WEIGHT_GRADIENT, Phase, Schedule, Task, Timed, make_schedule, timeline


class Stage(Protocol):
    """What a prediction reads of a plan's stage (:class:`~.plan.Stage`)."""

    device: Any
    forward_s: float
    backward_s: float
    transfer_s: float
    param_bytes: int
    frozen_bytes: int

    def backward_halves(self) -> tuple[float, float]: ...


class Plan(Protocol):
    """What a prediction reads of a plan (:class:`~.plan.Plan`)."""

    stages: Sequence[Stage]
    chunks: int
    schedule: str
    recompute: str
    task_overhead_s: float
    step_overhead_s: float
    optimizer_step_s: float
    parallel_capacity: float | None
    cpu_cores: int | None
    accumulate_s_per_byte: float
    gradient_shards: int
    accumulate_grad_batches: int

    @property
    def num_stages(self) -> int: ...

    @property
    def measured_together(self) -> bool: ...


def recomputed_micro_batches(recompute: str, chunks: int) -> int:
    """How many micro-batches, from the first, the runtime recomputes in backward under ``recompute``."""
    return {"never": 0, "except_last": chunks - 1, "always": chunks}[recompute]


class StepPrediction:
    """The step ``plan`` predicts: its tasks' seconds, their timeline, the step's length."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def timeline(self, schedule: Schedule | None = None, replicas: int = 1,
                 others: Sequence[tuple[float, float]] = (), held: Mapping[Task, float] | None = None
                 ) -> list[Timed]:
        """The predicted start and end of every task of one step (:func:`schedule.timeline`), each
        task as long as :meth:`durations` says. ``schedule``: the
        tasks as run (torch's table for a rank's virtual stages,
        :meth:`~lightning_antichain.plans.process_schedules.ProcessSchedule.table`); default,
        the plan's own schedule over one worker per stage. ``replicas``: pipelines running the
        same step at once, whose CPU stages share the machine with these; ``others``: spans of
        other work sharing it meanwhile (a rank's reduction and optimizer step); ``held``: seconds
        a task keeps its stage after its work, sharing nothing (a replicated stage's reduction)."""
        plan = self.plan
        schedule = schedule or make_schedule(plan.schedule, plan.num_stages, plan.chunks)
        if schedule.stages != plan.num_stages or schedule.chunks != plan.chunks:
            raise ValueError(f"a schedule of {schedule.stages} stages and {schedule.chunks} micro-batches does not "
                             f"run this plan of {plan.num_stages} stages and {plan.chunks}")
        return timeline(
            schedule,
            self.durations(schedule),
            capacity=self.capacity(replicas),
            shared=[shares_host(plan.stages[tasks[0].stage].device) and not plan.measured_together if tasks else False
                    for tasks in schedule.order],
            copies=replicas,
            others=others,
            held=held,
        )

    def durations(self, schedule: Schedule) -> Callable[[Task], float]:
        """Each task's seconds alone in ``schedule`` (:meth:`task_seconds`), with the forward again
        in the backward of a micro-batch that ``recompute`` recomputes, and the adding of its
        gradients into its stage's (:meth:`accumulation_s`) in every backward of the weights but
        the stage's first of the step, and in that one on average over the batches of
        ``accumulate_grad_batches`` (all but the window's first add)."""
        plan = self.plan
        recomputed = recomputed_micro_batches(plan.recompute, plan.chunks)
        first: dict[int, Task] = {}
        for tasks in schedule.order:
            for task in tasks:
                if task.phase in WEIGHT_GRADIENT:
                    first.setdefault(task.stage, task)

        def duration(task: Task) -> float:
            stage = plan.stages[task.stage]
            seconds = self.task_seconds(stage, task.phase)
            if task.phase in GRADIENT_OUT and task.micro_batch < recomputed:
                seconds += stage.forward_s
            if task.phase in WEIGHT_GRADIENT:
                later = first.get(task.stage) != task
                seconds += self.accumulation_s(stage) * (1.0 if later else 1.0 - 1.0 / plan.accumulate_grad_batches)
            return seconds

        return duration

    def accumulation_s(self, stage: Stage) -> float:
        """What a backward on ``stage`` adds where it adds into the gradients of an earlier one (its
        rank's share of them, :attr:`gradient_shards`)."""
        plan = self.plan
        return plan.accumulate_s_per_byte * max(0, stage.param_bytes - stage.frozen_bytes) / plan.gradient_shards

    def task_seconds(self, stage: Stage, phase: Phase) -> float:
        """What one task of ``phase`` on ``stage`` takes alone: its compute, half the stage's transfer
        (the input's gradient carries the backward's half), and the runtime's ``task_overhead_s``."""
        plan = self.plan
        half = stage.transfer_s / 2
        if phase == "forward":
            return stage.forward_s + half + plan.task_overhead_s
        if phase == "backward":
            return stage.backward_s + half + plan.task_overhead_s
        input_s, weight_s = stage.backward_halves()
        return (input_s + half if phase == "backward_input" else weight_s) + plan.task_overhead_s

    def capacity(self, replicas: int = 1) -> list[float]:
        """Work done by 1, 2, ... CPU stages (of ``replicas`` pipelines) running at once, in units
        of one alone: each stage beyond the first adds what the second added in the profile, while
        there are cores for it."""
        plan = self.plan
        count = plan.num_stages * replicas
        if plan.parallel_capacity is None:
            return [float(n) for n in range(1, count + 1)]
        cores = plan.cpu_cores or count
        extra = plan.parallel_capacity - 1.0
        return [1.0 + extra * (min(n, cores) - 1) for n in range(1, count + 1)]

    def step_s(self, schedule: Schedule | None = None, replicas: int = 1) -> float:
        """Seconds of one training step (under ``schedule``, with ``replicas`` pipelines at once,
        see :meth:`timeline`): the end of the timeline plus the per-step costs."""
        plan = self.plan
        return max(t.end for t in self.timeline(schedule, replicas)) + plan.step_overhead_s + plan.optimizer_step_s
