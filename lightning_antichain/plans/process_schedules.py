"""The schedules of the process runtime, as data: which of torch's schedule classes runs them, and
which stages each rank holds.

A schedule with virtual stages cuts the model into ``ranks * virtual_stages`` stages. Interleaved
schedules give rank ``r`` the stages ``r, r + ranks, r + 2 * ranks, ...`` (round robin); ZBV gives
it two stages in a V, ``r`` and ``2 * ranks - 1 - r``, so the first and the last stage share a rank
and the loss's gradient starts where the input's forward began. The steps themselves are torch's
(``torch.distributed.pipelining``); nothing here runs them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from ..torch_private import Action, ComputationType, ScheduleRuntime, add_send_recv
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
            actions, stage_to_rank=lambda s: runner.stage_index_to_group_rank[s], num_stages=runner._num_stages)

    def table(self, ranks: int, chunks: int) -> Schedule:
        """Each rank's tasks in the order torch's schedule runs them, as data the planner simulates
        (:func:`~lightning_antichain.plans.schedule.timeline`): torch's own table of actions for
        the interleaved and zero-bubble schedules, computed as its constructor does, without stages
        or a process group."""
        if not self.takes_a_list:
            single = gpipe(ranks, chunks) if self.name == "gpipe" else one_f_one_b(ranks, chunks)
            return replace(single, name=self.name, loss_per_micro_batch=True)
        planner: Any = object.__new__(self.runs_with)  # the table's arithmetic only: no stages, no group
        planner.pp_group_size, planner.n_local_stages, planner._n_microbatches = ranks, self.virtual_stages, chunks
        planner.number_of_rounds = max(1, chunks // ranks)
        planner.microbatches_per_round = chunks // planner.number_of_rounds
        planner._num_stages = planner.num_stages = self.num_stages(ranks)
        planner.pipeline_order = {rank: planner._calculate_single_rank_operations(rank) for rank in range(ranks)}
        if self.runs_with is ScheduleInterleavedZeroBubble:
            planner.pipeline_order = planner._add_bubbles_to_actions(self.num_stages(ranks))
        order = tuple(tuple(Task(_PHASES[action.computation_type], action.stage_index, action.microbatch_index)
                            for action in planner.pipeline_order[rank] if action is not None)
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
    runner = ScheduleRuntime(stages, chunks, loss_fn=loss_fn, scale_grads=False)
    # torch checks a training table's counts
    runner._prepare_schedule_with_comms(schedule.fill_drain_order(ranks, chunks, train=True))
    if not train:
        schedule.evaluate_forward_only(runner, ranks, chunks)
    return runner


def run_pre_split(runner: Any, arg_mbs: list[tuple] | None, target_mbs: list | None, train: bool) -> None:
    """One batch through torch's ``runner`` from micro-batches already split (``None`` where this
    rank holds neither the first stage nor the last): forward and backward when ``train``, else
    forward only.

    torch 2.11 (and older) has no ``arg_mbs``/``target_mbs`` in ``step`` and ``eval``: they fell into
    the whole-batch keyword inputs, which it tried to split (``IndexError: Dimension specified as 0
    but tensor has no dimensions`` on torch 2.11). There the micro-batches go to the runner's
    ``_step_microbatches`` with what ``step`` does first."""
    given = {"arg_mbs": arg_mbs, "target_mbs": target_mbs}
    given = {name: value for name, value in given.items() if value is not None}
    if "arg_mbs" in inspect.signature(runner.step).parameters:
        had_backward = runner._has_backward
        runner._has_backward = had_backward and train  # what torch's eval() does, with no outputs merged
        try:  # (joining the last stage's outputs fails on a 0-dim one, a loss, and nothing needs them)
            runner.step(**given, return_outputs=False)
        finally:
            runner._has_backward = had_backward
    else:
        run_through_step_microbatches(runner, arg_mbs, target_mbs, train)


def run_through_step_microbatches(runner: Any, arg_mbs: list[tuple] | None, target_mbs: list | None,
                                  train: bool) -> None:
    """:func:`run_pre_split` on a torch whose ``step`` takes whole batches only."""
    stages = runner._stages if isinstance(runner, PipelineScheduleMulti) else [runner._stage]
    had_backward = runner._has_backward
    runner._has_backward = had_backward and train
    try:
        for stage in stages:
            stage.has_backward = runner._has_backward
            stage.clear_runtime_states()
        takes = inspect.signature(runner._step_microbatches).parameters
        runner._step_microbatches(arg_mbs, None, target_mbs, None,
                                  **({"return_outputs": False} if "return_outputs" in takes else {}))
    finally:
        runner._has_backward = had_backward
