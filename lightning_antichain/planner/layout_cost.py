"""What a plan costs in one layout of replicas x stages: the step and each rank's memory.

A plan cut into stages predicts its step from the schedule's table of tasks (torch's, for stages
as processes). Laid out as ``dp`` replicas of a pipeline of ``pp`` ranks, three things change:
the ``dp`` pipelines run at once, so where they share a machine's CPU they slow each other as a
pipeline's own stages do; a cut between ranks on two nodes ships its values over the slower link
between nodes; and each stage's gradients are reduced over its replicas. DDP reduces them during
the last micro-batch's backward, bucket by bucket, so a rank's reduction delays its end of the
step only by what that backward does not hide, and at least by its last bucket. On a CPU the
reduction is work for the same cores, which hides nothing and slows the other ranks: the step
then lasts at least all ranks' work (tasks, reductions, optimizer steps) over what the cores get
through at once. FSDP2 (sharding
a stage whole) keeps ``1/dp`` of the optimizer state per rank; the parameters and gradients are
whole while the stage computes, and it gathers and reduces the same bytes as DDP. Each rank
steps the optimizer on its own parameters (its share of them, with FSDP2), all ranks at once: on
a shared CPU, as slowly as the ranks' sharing of its cores makes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..device import shares_host
from ..plans.layout import Layout
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule
from ..plans.schedule import Schedule
from ..processes.replication import Replication

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket: the last one is reduced after the backward that fills it ends."""


@dataclass(frozen=True)
class Links:
    """The bandwidth between two ranks, in GB/s (``None``: free): within a node of ``per_node``
    ranks, or across nodes."""

    per_node: int
    within_gbps: float | None = None
    across_gbps: float | None = None

    def between(self, a: int, b: int) -> float | None:
        if a == b:
            return None  # a process passes values to itself
        return self.within_gbps if a // self.per_node == b // self.per_node else self.across_gbps

    def slowest(self, ranks: Sequence[int]) -> float | None:
        """The slowest link a ring over ``ranks`` uses (``None``: all free)."""
        links = [self.between(a, b) for a, b in zip(ranks, [*ranks[1:], ranks[0]]) if a != b]
        known = [g for g in links if g is not None]
        return min(known) if known else None


def ring_all_reduce_s(nbytes: float, ranks: int, gbps: float | None) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks on links of ``gbps``."""
    if ranks <= 1 or gbps is None or nbytes <= 0:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbps * 1e9)


@dataclass(frozen=True)
class LayoutCost:
    """A plan's predicted step in a layout, what the replicas' reductions add to it, and each
    pipeline rank's peak memory (the same on every replica)."""

    step_s: float
    reduction_s: float
    rank_bytes: tuple[int, ...]

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_bytes)


def layout_cost(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links,
                replication: Replication = "ddp") -> LayoutCost:
    """``plan`` (cut into ``schedule.num_stages(layout.pp)`` stages) run under ``schedule`` as
    ``layout`` (see the module's docstring)."""
    pp, dp = layout.pp, layout.dp
    linked = _over_links(plan, schedule, layout, links)
    table = schedule.table(pp, plan.chunks)
    timed = linked.timeline(table, replicas=dp)
    holder = {s: schedule.rank_of(s, pp) for s in range(plan.num_stages)}
    ends = [0.0] * pp
    last_backward = [0.0] * pp  # the last micro-batch's backward, which DDP's reduction hides behind
    for t in timed:
        rank = holder[t.task.stage]
        ends[rank] = max(ends[rank], t.end)
        if t.task.phase != "forward" and t.task.micro_batch == plan.chunks - 1:
            last_backward[rank] += t.end - t.start
    finish, reductions = [], []
    for position in range(pp):
        stages = [linked.stages[s] for s in schedule.stages_of(position, pp)]
        hidden = 0.0 if any(shares_host(s.device) for s in stages) else last_backward[position]
        grads = sum(s.param_bytes - s.frozen_bytes for s in stages)
        gbps = links.slowest([layout.rank(d, position) for d in range(dp)])
        whole, tail = ring_all_reduce_s(grads, dp, gbps), ring_all_reduce_s(min(grads, BUCKET_BYTES), dp, gbps)
        reductions.append(whole if dp > 1 else 0.0)
        finish.append(ends[position] + (max(whole - hidden, tail) if dp > 1 else 0.0))
    optimizer_s = _optimizer_s(linked, schedule, layout, replication)
    end = max(finish)
    if any(shares_host(s.device) for s in linked.stages) and not linked.measured_together:
        ranks = layout.world_size
        work = dp * (_work_s(linked, table) + sum(reductions))
        capacity = linked.capacity(dp)[min(ranks, linked.num_stages * dp) - 1]
        end = max(end, work / capacity)
    step = end + linked.step_overhead_s + optimizer_s
    reduction = end - max(ends)
    rank_bytes = tuple(sum(_stage_bytes(linked, s, dp, replication) for s in schedule.stages_of(p, pp))
                       for p in range(pp))
    return LayoutCost(step, reduction, rank_bytes)


def _work_s(plan: Plan, table: Schedule) -> float:
    """The seconds of all of ``table``'s tasks, each as it takes alone: a pipeline's work."""
    return sum(plan.task_seconds(plan.stages[t.stage], t.phase) for tasks in table.order for t in tasks)


def _optimizer_s(plan: Plan, schedule: ProcessSchedule, layout: Layout, replication: Replication) -> float:
    """The optimizer step of the rank with the most parameters to step: the plan's whole step
    (timed alone) scaled by that rank's share of the trainable bytes, and by the CPU's sharing
    where every rank steps at once on one machine's cores."""
    trainable = [s.param_bytes - s.frozen_bytes for s in plan.stages]
    total = sum(trainable)
    if not total or not plan.optimizer_step_s:
        return 0.0
    share = max(sum(trainable[s] for s in schedule.stages_of(p, layout.pp)) for p in range(layout.pp)) / total
    if replication == "fsdp":
        share /= layout.dp
    slowdown = 1.0
    if any(shares_host(s.device) for s in plan.stages) and not plan.measured_together:
        ranks = layout.world_size
        slowdown = ranks / plan.capacity(layout.dp)[min(ranks, plan.num_stages * layout.dp) - 1]
    return plan.optimizer_step_s * share * slowdown


def _stage_bytes(plan: Plan, index: int, dp: int, replication: Replication) -> int:
    stage = plan.stages[index]
    if replication != "fsdp" or dp == 1:
        return stage.memory_bytes
    optimizer = (stage.param_bytes - stage.frozen_bytes) * plan.optimizer_multiplier
    return int(stage.memory_bytes - optimizer * (1 - 1 / dp))


def _over_links(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links) -> Plan:
    """``plan`` with each stage's transfer over the links its cuts cross in ``layout``: the input
    from the rank before, the output to the rank after (free within a rank)."""
    rank = [layout.rank(0, schedule.rank_of(s, layout.pp)) for s in range(plan.num_stages)]

    def seconds(nbytes: int, a: int, b: int) -> float:
        gbps = links.between(rank[a], rank[b])
        return 0.0 if gbps is None else 2.0 * nbytes / (gbps * 1e9)

    last = plan.num_stages - 1
    stages = [dataclasses.replace(
        s, transfer_s=(seconds(s.input_bytes, s.index - 1, s.index) if s.index > 0 else 0.0)
        + (seconds(s.output_bytes, s.index, s.index + 1) if s.index < last else 0.0)) for s in plan.stages]
    return dataclasses.replace(plan, stages=stages)
