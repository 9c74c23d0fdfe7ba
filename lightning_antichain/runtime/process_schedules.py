"""The schedules of the process runtime, as data: which of torch's schedule classes runs them, and
which stages each rank holds.

A schedule with virtual stages cuts the model into ``ranks * virtual_stages`` stages. Interleaved
schedules give rank ``r`` the stages ``r, r + ranks, r + 2 * ranks, ...`` (round robin); ZBV gives
it two stages in a V, ``r`` and ``2 * ranks - 1 - r``, so the first and the last stage share a rank
and the loss's gradient starts where the input's forward began. The steps themselves are torch's
(``torch.distributed.pipelining``); nothing here runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineScheduleRuntime,
)

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
        return issubclass(self.runs_with, _PipelineScheduleRuntime)

    def evaluate_forward_only(self, runner: _PipelineScheduleRuntime, ranks: int, chunks: int) -> None:
        """Make ``runner`` (torch's, for this schedule) run forwards only: every micro-batch through
        a rank's first stage, then through its next, so each stage waits only on stages run before
        it. torch's table for ZBV holds backward actions, which its ``eval`` would follow."""
        actions = {rank: [_Action(stage, _ComputationType.FORWARD, m) for stage in sorted(self.stages_of(rank, ranks))
                          for m in range(chunks)] for rank in range(ranks)}
        runner.pipeline_order_with_comms = _add_send_recv(
            actions, stage_to_rank=lambda s: runner.stage_index_to_group_rank[s], num_stages=runner._num_stages)

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
