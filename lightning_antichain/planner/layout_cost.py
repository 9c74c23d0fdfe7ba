"""What a plan costs in one layout of replicas x stages: the step and each rank's memory.

A plan cut into stages predicts its step from the schedule's table of tasks (torch's, for stages
as processes). Laid out as ``dp`` replicas of a pipeline of ``pp`` ranks, three things change:
the ``dp`` pipelines run at once, so where they share a machine's CPU they slow each other as a
pipeline's own stages do; a cut between ranks on two nodes ships its values over the slower link
between nodes; and the ranks that hold a stage keep their copies in step.

DDP reduces the gradients during a stage's last backward, bucket by bucket, so a stage's reduction
delays that backward only by what it does not hide, and at least by its last bucket; torch's stage
sends the input gradient once the backward returns, so the previous rank's last backward waits for
the reduction too. On a CPU the reduction hides nothing: the step then lasts at least all ranks'
tasks over what the cores get through at once (measured among the ranks where they are there to
ask: :func:`~lightning_antichain.planner.contention.processes_capacity`), then the collectives'
copying, timed with every rank in one at once, and their latencies, which are waiting, not work
(:mod:`~lightning_antichain.measure.link_speed`).
A value sent to the next rank costs its bytes and, between processes, a latency.

FSDP2 keeps ``1/dp`` of each parameter, gradient and optimizer state per rank and shards each
block (a decoder layer) on its own (:mod:`~lightning_antichain.stages.block_units`). Gathered per
micro-batch (``regather="micro_batch"``), every forward all-gathers the stage's parameters a block
at a time and every backward gathers the blocks again and reduce-scatters their gradients: a rank
holds its shards, the parameters outside blocks and two blocks (the one running, the next
prefetched), and a block's gradients before they are scattered, each backward's added into its
shard of them. On an accelerator the gathers of
the next block overlap the current one's compute, so a task lasts as long as the longer of the
two, plus the first block's gather; on a CPU they add. Gathered once per step
(``regather="step"``, torch's pipelining default), the whole stage is gathered for the first
forward and its gradients, kept whole, are reduce-scattered once after the last backward: the
fewest collectives, and the most memory (the stage whole besides its shards), each backward's
gradients added into the whole ones. Each rank steps the
optimizer on its own parameters (its share of them, with FSDP2) once its own step is done: on a
shared CPU, as slowly as the sharing of its cores with the ranks stepping at the same time makes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..device import shares_host
from ..measure.link_speed import CollectiveSpeed, Kind
from ..plans.layout import Layout
from ..plans.plan import Plan, Stage
from ..plans.process_schedules import ProcessSchedule
from ..plans.schedule import WEIGHT_GRADIENT, Schedule, Task, Timed
from ..processes.replication import Regather, Replication
from .contention import capacity_of_two
from .ring_collectives import ring_all_gather_s, ring_all_reduce_s
from .step_terms import StepTerms, step_terms

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket: the last one is reduced after the backward that fills it ends."""


@dataclass(frozen=True)
class Collective:
    """How one kind of collective runs on the links: what it costs whatever its bytes, in seconds,
    and its bandwidth as a multiple of the links' (an all-reduce's)."""

    latency_s: float = 0.0
    speed: float = 1.0


@dataclass(frozen=True)
class Links:
    """The bandwidth between two ranks, in GB/s (``None``: free): within a node of ``per_node``
    ranks, or across nodes; and how each kind of collective runs on them."""

    per_node: int
    within_gbps: float | None = None
    across_gbps: float | None = None
    #: what an all-reduce costs whatever its bytes, in seconds (measured between CPU processes,
    #: where it is milliseconds: the ranks meet through the host's scheduler)
    latency_s: float = 0.0
    #: FSDP2's all-gather and reduce-scatter, where they differ from the all-reduce (gloo's do);
    #: ``None``: as the all-reduce
    gather: Collective | None = None
    scatter: Collective | None = None
    #: a pipeline's send of a value to the next rank; ``None``: free but for its bytes
    send: Collective | None = None

    def kind(self, name: str) -> Collective:
        """How the collective ``name`` (``"gather"`` or ``"scatter"``) runs on these links."""
        found = getattr(self, name)
        return found if found is not None else Collective(self.latency_s)

    def between(self, a: int, b: int) -> float | None:
        if a == b:
            return None  # a process passes values to itself
        return self.within_gbps if a // self.per_node == b // self.per_node else self.across_gbps

    def slowest(self, ranks: Sequence[int]) -> float | None:
        """The slowest link a ring over ``ranks`` uses (``None``: all free)."""
        links = [self.between(a, b) for a, b in zip(ranks, [*ranks[1:], ranks[0]]) if a != b]
        known = [g for g in links if g is not None]
        return min(known) if known else None


def measured_links(per_node: int, measured: Mapping[Kind, CollectiveSpeed], within_gbps: float | None = None,
                   across_gbps: float | None = None) -> Links:
    """Links between CPU processes from the collectives ``measured`` on them
    (:func:`~lightning_antichain.measure.link_speed.measured_collectives`): the all-reduce's
    bandwidth (unless ``within_gbps`` is given; ``across_gbps`` defaults to it) and latency, and
    FSDP2's all-gather and reduce-scatter relative to it."""
    reduce = measured["all_reduce"]
    within = within_gbps if within_gbps is not None else reduce.gbps
    across = across_gbps if across_gbps is not None else within

    def kind(name: Kind) -> Collective:
        speed = measured[name]
        return Collective(speed.latency_s, speed.gbps / reduce.gbps)

    return Links(per_node, within, across, reduce.latency_s, kind("all_gather"), kind("reduce_scatter"),
                 kind("send") if "send" in measured else None)


@dataclass(frozen=True)
class LayoutCost:
    """A plan's predicted step in a layout, what the replicas' reductions add to it, the longest
    optimizer step of a rank (which may end before the step does), and each pipeline rank's peak
    memory (the same on every replica)."""

    step_s: float
    reduction_s: float
    rank_bytes: tuple[int, ...]
    optimizer_s: float = 0.0
    #: each pipeline position's optimizer step, seconds from its reduction's end (the longest: ``optimizer_s``)
    rank_optimizer_s: tuple[float, ...] = ()
    #: each pipeline position's end of its step, its optimizer's included, as its tasks' timeline
    #: says (the step may last longer: all ranks' work over what the shared cores get through)
    rank_end_s: tuple[float, ...] = ()
    #: each pipeline position's seconds in its tasks (each as long as the timeline has it, sharing
    #: the cores and holding DDP's reduction included): its step less its waits and its optimizer
    rank_busy_s: tuple[float, ...] = ()
    #: what the step is made of (:mod:`.step_terms`)
    terms: StepTerms | None = None

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_bytes)


def layout_cost(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links,
                replication: Replication = "ddp", regather: Regather = "step") -> LayoutCost:
    """``plan`` (cut into ``schedule.num_stages(layout.pp)`` stages) run under ``schedule`` as
    ``layout``, its stages kept in step by ``replication`` (with FSDP2, gathered as ``regather``
    says) (see the module's docstring)."""
    pp, dp = layout.pp, layout.dp
    linked = sent = _over_links(plan, schedule, layout, links)
    gathers = _Gathers(linked, schedule, layout, links, regather) if replication == "fsdp" and dp > 1 else None
    if gathers is not None:
        linked = gathers.in_tasks()
    linked = dataclasses.replace(linked, gradient_shards=gradient_shards(replication, regather, dp))
    table = schedule.table(pp, plan.chunks)
    holder = {s: schedule.rank_of(s, pp) for s in range(plan.num_stages)}
    reduced = _ddp_reductions(linked, schedule, layout, links, table) if gathers is None and dp > 1 else {}
    held = {task: exposed for task, (exposed, _, _) in reduced.items()}
    # DDP's reductions of each rank's stages, inside their last backwards: their seconds, and of them the waiting
    ddp = [(sum(r[1] for t, r in reduced.items() if holder[t.stage] == p),
            sum(r[2] for t, r in reduced.items() if holder[t.stage] == p)) for p in range(pp)]

    def ends_of(timed: Sequence[Timed]) -> tuple[list[float], list[float], list[float], list[float]]:
        """Each rank's last task's end and its step's end before the optimizer (with the replicas'
        collectives), and those collectives' seconds and waiting."""
        ends = [0.0] * pp
        for t in timed:
            ends[holder[t.task.stage]] = max(ends[holder[t.task.stage]], t.end)
        finish, reductions, waits = [], [], []  # the replicas' collectives per rank; of them, what is waiting
        for position in range(pp):
            if gathers is not None:  # FSDP2: what its tasks do not already carry
                exposed, waiting = gathers.at_step_ends(position)
                reductions.append(exposed)
                waits.append(waiting)
                finish.append(ends[position] + exposed)
                continue
            reductions.append(ddp[position][0])
            waits.append(ddp[position][1])
            finish.append(ends[position])
        return ends, finish, reductions, waits

    timed = linked.timeline(table, replicas=dp, held=held)
    ends, finish, reductions, waits = ends_of(timed)
    stepped = _optimizer_ends(linked, schedule, layout, replication, finish, timed, ends)
    shared = any(shares_host(s.device) for s in linked.stages) and not linked.measured_together
    tails = [(e, t) for e, t in zip(ends, stepped) if t > e and e < max(ends)]
    if shared and tails:  # the ranks done first reduce and step on the cores the others still compute on
        timed = linked.timeline(table, replicas=dp, others=tails, held=held)
        ends, finish, reductions, waits = ends_of(timed)
        stepped = _optimizer_ends(linked, schedule, layout, replication, finish, timed, ends)
    unreduced = max(t.end for t in linked.timeline(table, replicas=dp)) if held else max(ends)
    end, added = max(finish), max(stepped) - max(finish)
    if shared:
        # all ranks' tasks over what the cores get through at once; then the bytes their
        # collectives copy, timed with every rank in a collective at once (a pipeline's ranks in
        # turn: their mean), and the collectives' waiting, which takes no core
        ranks = layout.world_size
        capacity = linked.prediction.capacity(dp)[min(ranks, linked.num_stages * dp) - 1]
        moved = (sum(reductions) - sum(waits)) / pp
        end = max(end, dp * _work_s(linked, table) / capacity + moved + max(waits, default=0.0))
    step = end + added + linked.step_overhead_s
    reduction = end - unreduced
    rank_bytes = tuple(sum(_stage_bytes(linked, s, dp, replication, regather) for s in schedule.stages_of(p, pp))
                       for p in range(pp))
    optimizers = tuple(e - f for e, f in zip(stepped, finish))
    busy = [0.0] * pp
    for t in timed:
        busy[holder[t.task.stage]] += t.end - t.start
    terms = step_terms(plan, sent, schedule, layout, links, replication, regather, step, tuple(busy),
                       max(optimizers), reduction)
    return LayoutCost(step, reduction, rank_bytes, max(optimizers), optimizers,
                      tuple(e + linked.step_overhead_s for e in stepped), tuple(busy), terms)


def gradient_shards(replication: Replication, regather: Regather | None, dp: int) -> int:
    """Over how many ranks a stage's gradients are spread as each backward adds into them: FSDP2
    gathering per micro-batch reduce-scatters every backward's over the ``dp`` replicas; DDP, and
    FSDP2 gathering once per step, keep them whole until the last micro-batch."""
    return dp if replication == "fsdp" and regather == "micro_batch" else 1


def _ddp_reductions(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links, table: Schedule
                    ) -> dict[Task, tuple[float, float, float]]:
    """Each stage's DDP reduction, by the task it runs in: the stage's last backward (or, where the
    schedule takes backwards apart, its last weight gradients), whose input gradient the previous
    rank waits for until the reduction is done (torch's stage sends it after the backward returns,
    and DDP's backward returns once its buckets are reduced: the wide MLP's dp=2 x pp=2 measured
    1.25-1.64x a prediction that let the previous rank go on meanwhile). Each: what it adds to the
    task (on an accelerator, what that backward does not hide, and at least its last bucket; on
    a CPU, all of it), its seconds, and of them the collectives' waiting."""
    dp = layout.dp
    last: dict[int, Task] = {}
    for tasks in table.order:
        for task in tasks:
            if task.phase in WEIGHT_GRADIENT:
                last[task.stage] = task
    found = {}
    for index, task in last.items():
        stage = plan.stages[index]
        position = schedule.rank_of(index, layout.pp)
        grads = stage.param_bytes - stage.frozen_bytes
        gbps = links.slowest([layout.rank(d, position) for d in range(dp)])
        if grads <= 0 or gbps is None:
            continue
        buckets = math.ceil(grads / BUCKET_BYTES)
        whole = ring_all_reduce_s(grads, dp, gbps) + buckets * links.latency_s  # DDP: a collective a bucket
        tail = ring_all_reduce_s(min(grads, BUCKET_BYTES), dp, gbps, links.latency_s)
        hidden = 0.0 if shares_host(stage.device) else plan.prediction.task_seconds(stage, task.phase)
        found[task] = (max(whole - hidden, tail), whole, buckets * links.latency_s)
    return found


def _work_s(plan: Plan, table: Schedule) -> float:
    """The seconds of all of ``table``'s tasks, each as it takes alone: a pipeline's work."""
    duration = plan.prediction.durations(table)
    return sum(duration(t) for tasks in table.order for t in tasks)


def _optimizer_ends(plan: Plan, schedule: ProcessSchedule, layout: Layout, replication: Replication,
                    starts: Sequence[float], timed: Sequence[Timed], last_task_ends: Sequence[float] = ()
                    ) -> list[float]:
    """When each pipeline rank's optimizer step ends, begun once the rank's step ``starts`` to end
    it: the plan's whole step (timed alone) scaled by the rank's share of the trainable bytes, and
    under FSDP2 the DTensors' dispatch for each of its parameter tensors. On
    a shared CPU a step shares the cores with the tasks still running (``timed``), the other
    ranks' reductions (from ``last_task_ends[p]`` to ``starts[p]``) and
    steps, no better than the optimizers' own measured sharing (``plan.optimizer_slowdown``): a
    pipeline's ranks end their backwards one after another, so their steps overlap little (a
    wide MLP's AdamW, 4 stages: 34-50 ms measured, where all at once would take 100-126), but a
    step beside a gloo all-reduce shares the cores with it (the MLP's dp=2 x pp=2: the second
    stage's AdamW 92-96 ms beside the first's reduction, 47 predicted without it)."""
    trainable = [s.param_bytes - s.frozen_bytes for s in plan.stages]
    total = sum(trainable)
    if not total or not plan.optimizer_step_s:
        return list(starts)
    sharded = replication == "fsdp" and layout.dp > 1
    work = [plan.optimizer_step_s * sum(trainable[s] for s in schedule.stages_of(p, layout.pp)) / total
            / (layout.dp if sharded else 1) for p in range(layout.pp)]
    if sharded:  # each of FSDP2's parameters is a DTensor, every operation of the step dispatched by it
        tensors = [sum(plan.stages[s].param_tensors for s in schedule.stages_of(p, layout.pp))
                   for p in range(layout.pp)]
        work = [w + plan.optimizer_tensor_s * n for w, n in zip(work, tensors)]
    if not any(shares_host(s.device) for s in plan.stages) or plan.measured_together:
        return [start + w for start, w in zip(starts, work)]
    ranks = layout.world_size
    curve = plan.prediction.capacity(layout.dp)
    if plan.optimizer_slowdown:  # the optimizers' own sharing, as the model's is shaped
        stepping = dataclasses.replace(plan, parallel_capacity=capacity_of_two(
            ranks / plan.optimizer_slowdown, ranks, plan.cpu_cores or ranks))
        curve = stepping.prediction.capacity(layout.dp)
    others = [(t.start, t.end) for t in timed] + [(e, s) for e, s in zip(last_task_ends, starts) if s > e]
    return shared_ends(starts, work, layout.dp, lambda n: curve[min(n, len(curve)) - 1], others)


def shared_ends(starts: Sequence[float], work: Sequence[float], copies: int, capacity: Callable[[int], float],
                others: Sequence[tuple[float, float]] = ()) -> list[float]:
    """When each of the jobs ends, job ``k`` begun at ``starts[k]`` with ``work[k]`` seconds of
    work alone, ``copies`` of each running in step, where ``n`` running at once get through
    ``capacity(n)`` times the work of one alone, each an equal share; ``others``: the spans of
    other work (``copies`` of each) that shares the cores with them meanwhile."""
    left = list(work)
    ends = [math.inf] * len(starts)
    changes = sorted({t for span in others for t in span})
    now = min(starts, default=0.0)
    while any(e == math.inf for e in ends):
        running = [k for k, e in enumerate(ends) if e == math.inf and starts[k] <= now]
        waiting = [starts[k] for k, e in enumerate(ends) if e == math.inf and starts[k] > now]
        if not running:
            now = min(waiting)
            continue
        count = copies * (len(running) + sum(1 for start, end in others if start <= now < end))
        rate = capacity(count) / count
        upcoming = [t for t in (*waiting, *changes) if t > now]
        step = min(min(left[k] for k in running) / rate, min(upcoming, default=math.inf) - now)
        now += step
        for k in running:
            left[k] -= step * rate
            if left[k] <= 1e-12 * max(1.0, now):
                ends[k] = now
    return ends


def _stage_bytes(plan: Plan, index: int, dp: int, replication: Replication, regather: Regather) -> int:
    """A stage's peak on its rank: as planned alone (DDP keeps whole copies), or with FSDP2's
    shards, what it gathers at once, and ``1/dp`` of the optimizer state."""
    stage = plan.stages[index]
    if replication != "fsdp" or dp == 1:
        return stage.memory_bytes
    params, grads = stage.param_bytes, stage.param_bytes - stage.frozen_bytes
    optimizer = grads * plan.optimizer_multiplier
    rest = stage.memory_bytes - params - grads - optimizer
    if regather == "micro_batch":
        largest, unblocked = _blocks(stage)
        gathered = min(params, unblocked + 2 * largest)
        unscattered = min(grads, max(largest, unblocked))  # the gradients of one unit, before they scatter
    else:
        gathered, unscattered = params, grads
    return int(rest + params / dp + gathered + grads / dp + unscattered + optimizer / dp)


def _blocks(stage: Stage) -> tuple[int, int]:
    """The stage's largest block's parameter bytes and those outside blocks; a stage that says
    nothing of its blocks (a plan made by hand) has all its parameters outside them."""
    if stage.largest_block_bytes or stage.unblocked_param_bytes:
        return stage.largest_block_bytes, stage.unblocked_param_bytes
    return 0, stage.param_bytes


class _Gathers:
    """FSDP2's collectives in a layout: per micro-batch in the stages' tasks, or once per step."""

    def __init__(self, plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links,
                 regather: Regather) -> None:
        self.plan, self.schedule, self.layout, self.regather = plan, schedule, layout, regather
        self.gather, self.scatter = links.kind("gather"), links.kind("scatter")
        self.gbps = [links.slowest([layout.rank(d, schedule.rank_of(s, layout.pp)) for d in range(layout.dp)])
                     for s in range(plan.num_stages)]

    def _gather_s(self, index: int, nbytes: float, collectives: int = 0) -> float:
        """Seconds of all-gathering ``nbytes`` of stage ``index``'s parameters in ``collectives`` calls."""
        return self._moved_s(self.gather, index, nbytes, collectives)

    def _scatter_s(self, index: int, nbytes: float, collectives: int = 0) -> float:
        """Seconds of reduce-scattering ``nbytes`` of stage ``index``'s gradients in ``collectives`` calls."""
        return self._moved_s(self.scatter, index, nbytes, collectives)

    def _moved_s(self, kind: Collective, index: int, nbytes: float, collectives: int) -> float:
        gbps = self.gbps[index]
        if gbps is None or self.layout.dp <= 1:
            return 0.0
        return ring_all_gather_s(nbytes, self.layout.dp, gbps * kind.speed) + collectives * kind.latency_s

    def in_tasks(self) -> Plan:
        """The plan with each task carrying the gathers and reductions of its micro-batch (none
        where the stage is gathered once per step)."""
        if self.regather == "step":
            return self.plan
        stages = []
        for stage in self.plan.stages:
            params, grads = stage.param_bytes, stage.param_bytes - stage.frozen_bytes
            largest, unblocked = _blocks(stage)
            units = self._units(stage)
            forward = self._gather_s(stage.index, params, units)
            backward = (self._gather_s(stage.index, params - unblocked, min(units, stage.param_blocks))
                        + self._scatter_s(stage.index, grads, units))  # the blocks gathered again, all scattered
            first = self._gather_s(stage.index, largest)
            if shares_host(stage.device):  # the cores that compute also move the bytes
                stages.append(dataclasses.replace(stage, forward_s=stage.forward_s + forward,
                                                  backward_s=stage.backward_s + backward))
            else:  # the next block's gather behind this one's compute
                stages.append(dataclasses.replace(stage, forward_s=max(stage.forward_s, forward) + first,
                                                  backward_s=max(stage.backward_s, backward) + first))
        return dataclasses.replace(self.plan, stages=stages)

    def at_step_ends(self, position: int) -> tuple[float, float]:
        """What rank ``position``'s step adds outside its tasks: once per step, the whole stage's
        gather before its first forward (prefetched block by block behind it, on an accelerator)
        and its gradients' reduce-scatter after the last backward; and of it, the collectives'
        latencies (waiting, not work)."""
        if self.regather == "micro_batch":
            return 0.0, 0.0
        total = waiting = 0.0
        for index in self.schedule.stages_of(position, self.layout.pp):
            stage = self.plan.stages[index]
            units = self._units(stage)
            gather = self._gather_s(index, stage.param_bytes)
            if not shares_host(stage.device):
                gather = max(gather - stage.forward_s, self._gather_s(index, _blocks(stage)[0]))
            latencies = self._gather_s(index, 0.0, units) + self._scatter_s(index, 0.0, units)
            total += gather + latencies + self._scatter_s(index, stage.param_bytes - stage.frozen_bytes)
            waiting += latencies
        return total, waiting

    def _units(self, stage: Stage) -> int:
        """FSDP2's units in ``stage``, each gathered and reduce-scattered by a collective of its
        own: its blocks, and the stage for what no block owns; none where nothing is sent."""
        if self.layout.dp <= 1 or self.gbps[stage.index] is None:
            return 0
        return stage.param_blocks + (1 if _blocks(stage)[1] or not stage.param_blocks else 0)


def _over_links(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links) -> Plan:
    """``plan`` with each stage's transfer over the links its cuts cross in ``layout``: the input
    from the rank before, the output to the rank after (free within a rank)."""
    rank = [layout.rank(0, schedule.rank_of(s, layout.pp)) for s in range(plan.num_stages)]

    send = links.send or Collective()

    def seconds(nbytes: int, a: int, b: int) -> float:  # the value, and its gradient back; a latency split by the ends
        gbps = links.between(rank[a], rank[b])
        return 0.0 if gbps is None else 2.0 * nbytes / (gbps * send.speed * 1e9) + send.latency_s

    last = plan.num_stages - 1
    stages = [dataclasses.replace(
        s, transfer_s=(seconds(s.input_bytes, s.index - 1, s.index) if s.index > 0 else 0.0)
        + (seconds(s.output_bytes, s.index, s.index + 1) if s.index < last else 0.0)) for s in plan.stages]
    return dataclasses.replace(plan, stages=stages)
