"""The pipeline schedule as data: which tasks each stage runs, and in which order.

As torchgpipe keeps its ``clock_cycles`` apart from running them, a :class:`Schedule` lists each
stage's tasks (the forward or the backward of one micro-batch) in the order the stage runs them.
Three parts read the same list: the engine runs it, the planner predicts a step by simulating it
(:func:`timeline`), and the plot draws that simulation. The in-process runtime runs GPipe's
fill-drain (:func:`gpipe`) with the loss on the joined output of the whole batch; the process
runtime runs torch's schedules (:mod:`.process_schedules`), whose loss is per micro-batch, and
1F1B (:func:`one_f_one_b`) keeps at most ``K - k`` micro-batches in flight on stage ``k``
(:func:`in_flight`). A worker's list may hold the tasks of several stages (a rank's virtual
stages under torch's interleaved and zero-bubble schedules), and a backward may come in two
halves, as zero-bubble schedules split it: the gradient of the stage's input, which the stage
before waits for, and that of its weights, which nobody waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Phase = Literal["forward", "backward", "backward_input", "backward_weight"]
GRADIENT_OUT: tuple[Phase, ...] = ("backward", "backward_input")
"""The phases that make a stage's input gradient: the stage before waits for one of them."""
WEIGHT_GRADIENT: tuple[Phase, ...] = ("backward", "backward_weight")
"""The phases that make the gradients of a stage's parameters."""


@dataclass(frozen=True)
class Task:
    """The forward or backward of micro-batch ``micro_batch`` on stage ``stage``."""

    phase: Phase
    stage: int
    micro_batch: int


@dataclass(frozen=True)
class Schedule:
    """Every worker's tasks in the order it runs them (``order[w]``): worker k runs stage k, or,
    where ``num_stages`` says there are more stages than workers, the stages its tasks name."""

    name: str
    chunks: int
    order: tuple[tuple[Task, ...], ...]
    #: the loss is computed per micro-batch (torch's schedules), so the last stage's backward of a
    #: micro-batch waits for its own forward only, not for the whole batch's
    loss_per_micro_batch: bool = False
    #: the model's stages, where workers hold several (``None``: one per worker)
    num_stages: int | None = None

    @property
    def stages(self) -> int:
        return len(self.order) if self.num_stages is None else self.num_stages

    @property
    def workers(self) -> int:
        return len(self.order)

    def micro_batches(self, stage: int, phase: Phase) -> list[int]:
        """The micro-batches stage ``stage`` runs in ``phase``, in its order."""
        return [t.micro_batch for t in self.order[stage] if t.phase == phase]


def gpipe(stages: int, chunks: int) -> Schedule:
    """GPipe's fill-drain: every stage runs the forwards of micro-batches 0 .. M-1, then, once the
    loss of the whole batch has its gradient, their backwards M-1 .. 0."""
    if stages < 1 or chunks < 1:
        raise ValueError(f"a schedule needs at least one stage and one micro-batch, got {stages} and {chunks}")
    forwards = [[Task("forward", k, m) for m in range(chunks)] for k in range(stages)]
    backwards = [[Task("backward", k, m) for m in reversed(range(chunks))] for k in range(stages)]
    return Schedule("gpipe", chunks, tuple(tuple(f + b) for f, b in zip(forwards, backwards)))


def one_f_one_b(stages: int, chunks: int) -> Schedule:
    """1F1B (PipeDream-flush): stage k runs ``min(K - k - 1, M)`` forwards to fill the pipeline,
    then alternates one forward and one backward, then drains the backwards left; backwards go in
    micro-batch order, each right after the loss of its own micro-batch."""
    if stages < 1 or chunks < 1:
        raise ValueError(f"a schedule needs at least one stage and one micro-batch, got {stages} and {chunks}")
    order = []
    for k in range(stages):
        warmup = min(stages - k - 1, chunks)
        tasks = [Task("forward", k, m) for m in range(warmup)]
        for m in range(chunks - warmup):
            tasks += [Task("forward", k, warmup + m), Task("backward", k, m)]
        tasks += [Task("backward", k, m) for m in range(chunks - warmup, chunks)]
        order.append(tuple(tasks))
    return Schedule("1f1b", chunks, tuple(order), loss_per_micro_batch=True)


def in_flight(schedule: Schedule) -> list[int]:
    """Per worker, the most micro-batches whose forward has run and whose backward has not (the
    gradient of the weights, where it comes apart): how many micro-batches' activations it holds
    at once."""
    held = []
    for tasks in schedule.order:
        now = most = 0
        for task in tasks:
            now += {"forward": 1, "backward_input": 0}.get(task.phase, -1)
            most = max(most, now)
        held.append(most)
    return held


def held_at_peak(schedule: Schedule, per_micro_batch: Sequence[float]) -> list[float]:
    """Per worker, the most its stages keep for backward at once, where a micro-batch in flight on
    stage k keeps ``per_micro_batch[k]`` (bytes): :func:`in_flight` weighed by stage, for a worker
    holding several."""
    peaks = []
    for tasks in schedule.order:
        now = most = 0.0
        for task in tasks:
            now += {"forward": 1, "backward_input": 0}.get(task.phase, -1) * per_micro_batch[task.stage]
            most = max(most, now)
        peaks.append(most)
    return peaks


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def runs_in_process(name: str) -> bool:
    """Whether the in-process runtime runs schedule ``name``: it computes the loss once, on the
    whole batch's joined output, so a schedule whose loss is per micro-batch needs one process per
    stage."""
    return not make_schedule(name, 1, 1).loss_per_micro_batch


def make_schedule(name: str, stages: int, chunks: int) -> Schedule:
    """The schedule called ``name`` (see :data:`SCHEDULES`) for ``stages`` and ``chunks``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[name](stages, chunks)


@dataclass(frozen=True)
class Timed:
    """A task with its predicted start and end, in seconds from the start of the step."""

    task: Task
    start: float
    end: float


def timeline(
    schedule: Schedule,
    duration: Callable[[Task], float],
    *,
    capacity: Sequence[float] = (1.0,),
    shared: Sequence[bool] | None = None,
    copies: int = 1,
    others: Sequence[tuple[float, float]] = (),
    held: Mapping[Task, float] | None = None,
) -> list[Timed]:
    """When each task runs, if each takes ``duration(task)`` seconds when it runs alone.

    A task starts once its stage has finished the task before it in the stage's order and its input
    is there: a forward needs the previous stage's forward of the same micro-batch, a backward the
    next stage's backward of it. The last stage's backwards need every forward of the last stage,
    since the loss is computed on the joined output of the whole batch; or, where the schedule
    computes it per micro-batch, the forward of their own micro-batch.

    Stages marked ``shared`` (CPU stages: they share the machine's cores, memory bus and
    interpreter lock) slow each other down while they run at once: ``n`` of them together get
    through ``capacity[n - 1]`` times the work of one alone (the last entry holds for more), each
    at an equal share. Other stages run at full speed whatever else runs. ``copies``: each worker
    stands for that many running the same tasks in step (pipeline replicas), which share the
    machine too. ``others``: spans of other work on the shared cores (a rank's gradient reduction
    and optimizer step after its last task), each as busy as a shared stage (``copies`` of each).
    ``held``: seconds a task keeps its stage after its work is done, sharing nothing and slowed by
    nothing (a replicated stage's gradient reduction in its last backward, timed as the ranks run it
    at once), before what waits for it may start.
    """
    shared = [False] * schedule.workers if shared is None else list(shared)
    held = held or {}
    waits_for = prerequisites(schedule)
    end: dict[Task, float] = {}
    position = [0] * schedule.workers
    running: dict[int, tuple[Task, float, float, float]] = {}  # stage -> (task, start, work left, held left)
    timed: list[Timed] = []
    now = 0.0
    total = sum(len(tasks) for tasks in schedule.order)
    while len(end) < total:
        for k, tasks in enumerate(schedule.order):
            if k not in running and position[k] < len(tasks):
                task = tasks[position[k]]
                if all(t in end for t in waits_for(task)):
                    running[k] = (task, now, duration(task), held.get(task, 0.0))
        if not running:
            waiting = [tasks[position[k]] for k, tasks in enumerate(schedule.order) if position[k] < len(tasks)]
            raise ValueError(f"schedule {schedule.name!r} deadlocks: every stage waits ({waiting})")
        working = [k for k, (_, _, left, _) in running.items() if left > 0.0]
        own = sum(1 for k in working if shared[k])
        together = copies * (own + sum(1 for start, stop in others if start <= now < stop)) if own else 0
        share = capacity[min(together, len(capacity)) - 1] / together if together else 1.0
        rate = {k: share if shared[k] else 1.0 for k in working}
        step = min(running[k][2] / rate[k] if k in rate else running[k][3] for k in running)
        if others:
            step = min([step, *(t - now for span in others for t in span if t > now)])
        now += step
        for k, (task, start, left, kept) in list(running.items()):
            if k in rate:
                left -= step * rate[k]
                if left <= 1e-12 * max(1.0, now):
                    left = 0.0
            else:
                kept -= step
            if left == 0.0 and kept <= 1e-12 * max(1.0, now):
                end[task] = now
                timed.append(Timed(task, start, now))
                position[k] += 1
                del running[k]
            else:
                running[k] = (task, start, left, kept)
    return timed


def prerequisites(schedule: Schedule) -> Callable[[Task], list[Task]]:
    """What each task of ``schedule`` waits for, besides the task before it on its worker (see
    :func:`timeline`)."""
    last = schedule.stages - 1
    all_forwards = [Task("forward", last, m) for m in range(schedule.chunks)]
    gradient_of = {(t.stage, t.micro_batch): t for tasks in schedule.order for t in tasks if t.phase in GRADIENT_OUT}

    def waits_for(task: Task) -> list[Task]:
        if task.phase == "forward":
            return [Task("forward", task.stage - 1, task.micro_batch)] if task.stage > 0 else []
        if task.phase == "backward_weight":
            return [Task("backward_input", task.stage, task.micro_batch)]
        if task.stage == last:
            return [Task("forward", last, task.micro_batch)] if schedule.loss_per_micro_batch else all_forwards
        return [gradient_of[task.stage + 1, task.micro_batch]]

    return waits_for


INPUT_SHARE = 0.5
"""The share of a backward that the gradient of its input takes, where a zero-bubble schedule
splits it from that of the weights (about half for matrix products: one product each)."""


def stage_durations(forward: Sequence[float], backward: Sequence[float],
                    input_share: float = INPUT_SHARE) -> Callable[[Task], float]:
    """Every micro-batch taking ``forward[k]`` and ``backward[k]`` seconds on stage k; a backward
    split in two, ``input_share`` of it for the input's gradient and the rest for the weights'."""
    share = {"forward": 1.0, "backward": 1.0, "backward_input": input_share, "backward_weight": 1.0 - input_share}
    return lambda task: (forward if task.phase == "forward" else backward)[task.stage] * share[task.phase]


def step_time(schedule: Schedule, forward: Sequence[float], backward: Sequence[float]) -> float:
    """The predicted length of one step: the end of the last task of :func:`timeline`.

    >>> step_time(gpipe(2, 4), [1.0, 1.0], [2.0, 2.0])  # (M + K - 1) * (f + b)
    15.0
    """
    return max(t.end for t in timeline(schedule, stage_durations(forward, backward)))
