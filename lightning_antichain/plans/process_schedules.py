"""The schedules of the process runtime, as data: which of torch's schedule classes runs them, and
which stages each rank holds.

A schedule with virtual stages cuts the model into ``ranks * virtual_stages`` stages. Interleaved
schedules give rank ``r`` the stages ``r, r + ranks, r + 2 * ranks, ...`` (round robin); ZBV gives
it two stages in a V, ``r`` and ``2 * ranks - 1 - r``, so the first and the last stage share a rank
and the loss's gradient starts where the input's forward began. The steps themselves are torch's
(``torch.distributed.pipelining``); nothing here runs them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from ..torch_private import (
    Action,
    ComputationType,
    ScheduleRuntime,
    add_send_recv,
    runtime_of_actions,
    step_micro_batches,
)
from .schedule import Schedule, Task, gpipe, one_f_one_b

#: torch's kinds of action -> the phases of :class:`~lightning_antichain.plans.schedule.Task`
_PHASES = {ComputationType.FORWARD: "forward", ComputationType.FULL_BACKWARD: "backward",
           ComputationType.BACKWARD_INPUT: "backward_input", ComputationType.BACKWARD_WEIGHT: "backward_weight"}

#: name -> torch's class, the virtual stages per rank it takes (None: any count from 1), and the
#: order of a rank's stages
_SCHEDULES: dict[str, tuple[type, int | None, str]] = {
    "gpipe": (ScheduleGPipe, 1, "loop"),
    "1f1b": (Schedule1F1B, 1, "loop"),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, None, "loop"),
    "zb-h1": (ScheduleInterleavedZeroBubble, None, "loop"),
    "zbv": (ScheduleZBVZeroBubble, 2, "v"),
}
SCHEDULE_NAMES = tuple(_SCHEDULES)


class _StagePlace:
    """What torch's schedule constructors read of a stage: where it sits in the pipeline. Enough
    for them to make every rank's table of actions, with no module and no process group."""

    def __init__(self, index: int, num_stages: int, ranks: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_rank, self.group_size = 0, ranks
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank: dict[int, int] = {}


def _no_loss(output: Any, target: Any) -> Any:
    """A loss for the constructors, which plan a backward only where there is one."""
    return output


@functools.cache
def _torch_order(schedule: ProcessSchedule, ranks: int, chunks: int) -> dict[int, list[Action | None]]:
    """Every rank's actions as torch's constructor of ``schedule`` orders them for ``chunks``
    micro-batches on ``ranks`` ranks (``None``: a bubble). Made once per count: the layout search
    asks for the same tables many times."""
    stages = [_StagePlace(index, schedule.num_stages(ranks), ranks) for index in schedule.stages_of(0, ranks)]
    return schedule.runs_with(stages, chunks, loss_fn=_no_loss, scale_grads=False).pipeline_order


@dataclass(frozen=True)
class ProcessSchedule:
    """A named schedule with ``virtual_stages`` stages per rank, and torch's class that runs it."""

    name: str
    runs_with: type
    virtual_stages: int
    shape: str

    @property
    def takes_a_list(self) -> bool:
        """Whether torch's class takes the rank's stages as a list (several per rank) or one stage."""
        return issubclass(self.runs_with, PipelineScheduleMulti)

    def num_stages(self, ranks: int) -> int:
        return ranks * self.virtual_stages

    def stages_of(self, rank: int, ranks: int) -> list[int]:
        """The indices of the stages rank ``rank`` of ``ranks`` holds, in the order it holds them."""
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of {ranks} ranks")
        if self.shape == "v":
            return [rank, 2 * ranks - 1 - rank]
        return [rank + i * ranks for i in range(self.virtual_stages)]

    @property
    def runs_by_table(self) -> bool:
        """Whether torch runs it from a table of actions per rank (ZBV), which its ``eval`` follows
        backward actions included: such a schedule evaluates by :meth:`evaluate_forward_only`."""
        return issubclass(self.runs_with, ScheduleRuntime)

    @property
    def splits_backward(self) -> bool:
        """Whether torch's class takes input and weight gradients apart (the zero-bubble ones)."""
        return self.name in ("zb-h1", "zbv")

    def takes(self, chunks: int, ranks: int) -> bool:
        """Whether torch's class runs ``chunks`` micro-batches on ``ranks`` ranks: 1F1B and ZBV
        need one per stage at least, the interleaved ones a whole number of rounds."""
        if self.name in ("1f1b", "zbv"):
            return chunks >= self.num_stages(ranks)
        if self.takes_a_list:
            return chunks % max(1, chunks // ranks) == 0
        return True

    def fill_drain_order(self, ranks: int, chunks: int, train: bool = True) -> dict[int, list[Action]]:
        """GPipe's order for this schedule's stages: on each rank, every micro-batch's forward
        through its stages in pipeline order, then (``train``) every backward in reverse. It runs
        any count of micro-batches on any placement of stages, since each task waits only on tasks
        of earlier stages (later, in backward) that their ranks run first: the order for a batch
        the schedule itself does not take (:meth:`takes`)."""
        order: dict[int, list[Action]] = {}
        for rank in range(ranks):
            held = sorted(self.stages_of(rank, ranks))
            order[rank] = [Action(s, ComputationType.FORWARD, m) for s in held for m in range(chunks)]
            if train:
                order[rank] += [Action(s, ComputationType.FULL_BACKWARD, m) for s in reversed(held)
                                for m in reversed(range(chunks))]
        return order

    def evaluate_forward_only(self, runner: ScheduleRuntime, ranks: int, chunks: int) -> None:
        """Make ``runner`` (torch's, for this schedule) run forwards only: every micro-batch through
        a rank's first stage, then through its next, so each stage waits only on stages run before
        it. torch's table for ZBV holds backward actions, which its ``eval`` would follow."""
        actions = {rank: [Action(stage, ComputationType.FORWARD, m) for stage in sorted(self.stages_of(rank, ranks))
                          for m in range(chunks)] for rank in range(ranks)}
        runner.pipeline_order_with_comms = add_send_recv(
            actions, stage_to_rank=lambda s: runner.stage_index_to_group_rank[s], num_stages=self.num_stages(ranks))

    def table(self, ranks: int, chunks: int) -> Schedule:
        """Each rank's tasks in the order torch's schedule runs them, as data the planner simulates
        (:func:`~lightning_antichain.plans.schedule.timeline`): for the interleaved and zero-bubble
        schedules, the ``pipeline_order`` torch's constructor makes for every rank, given where
        this rank's stages sit (:class:`_StagePlace`): no modules, no process group."""
        if not self.takes_a_list:
            single = gpipe(ranks, chunks) if self.name == "gpipe" else one_f_one_b(ranks, chunks)
            return replace(single, name=self.name, loss_per_micro_batch=True)
        pipeline_order = _torch_order(self, ranks, chunks)
        order = tuple(tuple(Task(_PHASES[action.computation_type], action.stage_index, action.microbatch_index)
                            for action in pipeline_order[rank] if action is not None)
                      for rank in range(ranks))
        return Schedule(self.name, chunks, order, loss_per_micro_batch=True, num_stages=self.num_stages(ranks))

    def tasks_of(self, rank: int, ranks: int, chunks: int, train: bool) -> list[Task]:
        """The tasks rank ``rank`` runs for a batch of ``chunks`` micro-batches, in its order: the
        schedule's table, GPipe's order for a count the schedule does not take, and forwards only,
        stage after stage, where it does not ``train``."""
        if not train:
            return [Task("forward", stage, m) for stage in sorted(self.stages_of(rank, ranks)) for m in range(chunks)]
        if self.takes(chunks, ranks):
            return list(self.table(ranks, chunks).order[rank])
        return [Task(_PHASES[a.computation_type], a.stage_index, a.microbatch_index)
                for a in self.fill_drain_order(ranks, chunks)[rank]]

    def rank_of(self, stage: int, ranks: int) -> int:
        """The rank that holds stage ``stage``."""
        for rank in range(ranks):
            if stage in self.stages_of(rank, ranks):
                return rank
        raise ValueError(f"stage {stage} is not one of the {self.num_stages(ranks)} stages of {ranks} ranks")


def process_schedule(name: str, virtual_stages: int | None = None) -> ProcessSchedule:
    """The schedule called ``name`` (:data:`SCHEDULE_NAMES`) with ``virtual_stages`` per rank
    (default: what it needs, 2 for the interleaved ones); a clear error for what it cannot run."""
    key = name.lower().replace("_", "-")
    if key not in _SCHEDULES:
        raise ValueError(f"schedule={name!r} is not one of {', '.join(SCHEDULE_NAMES)}")
    runs_with, needs, shape = _SCHEDULES[key]
    count = virtual_stages if virtual_stages is not None else (needs or 2)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"virtual_stages must be a whole number of at least 1, got {virtual_stages!r}")
    if needs is not None and count != needs:
        raise ValueError(f"schedule={key!r} holds {needs} stage(s) per rank, not virtual_stages={count}"
                         + ("; use interleaved-1f1b or zb-h1 for more" if needs == 1 else ""))
    assert issubclass(runs_with, (PipelineScheduleSingle, PipelineScheduleMulti))
    return ProcessSchedule(key, runs_with, count, shape)


def fill_drain_runner(schedule: ProcessSchedule, stages: list[Any], ranks: int, chunks: int,
                      loss_fn: Any, train: bool) -> ScheduleRuntime:
    """torch's runtime for tables of actions, running this rank's ``stages`` in
    :meth:`ProcessSchedule.fill_drain_order` (``scale_grads=False``, as :func:`schedule_runner`)."""
    # torch checks a training table's counts
    runner = runtime_of_actions(stages, chunks, loss_fn, schedule.fill_drain_order(ranks, chunks, train=True))
    if not train:
        schedule.evaluate_forward_only(runner, ranks, chunks)
    return runner


def run_pre_split(runner: Any, arg_mbs: list[tuple] | None, target_mbs: list | None, train: bool) -> None:
    """One batch through torch's ``runner`` from micro-batches already split (``None`` where this
    rank holds neither the first stage nor the last): forward and backward when ``train``, else
    forward only (torch's ``eval``). The last stage's outputs are not joined: nothing needs them,
    and a 0-dim one (a loss) cannot be.

    torch 2.13 has no ``arg_mbs``/``target_mbs`` in ``step`` and ``eval``: they would fall into
    the whole-batch keyword inputs, which it tries to split. There the micro-batches go through
    :func:`~lightning_antichain.torch_private.step_micro_batches`."""
    given = {"arg_mbs": arg_mbs, "target_mbs": target_mbs}
    given = {name: value for name, value in given.items() if value is not None}
    if "arg_mbs" not in inspect.signature(runner.step).parameters:
        step_micro_batches(runner, arg_mbs, target_mbs, train)
    elif train:
        runner.step(**given, return_outputs=False)
    else:
        runner.eval(**given, return_outputs=False)  # eval passes what it does not name on to step
