"""``pipeline_parallel_size="auto"``: the layout of replicas x stages, the schedule and the
micro-batch count that train fastest in memory, as the cost model predicts them.

Every rank gets the whole batch and each of ``dp`` replicas runs an equal ``1/dp`` of it, so a
layout never changes what training computes and the planner may choose it. For every
factorisation of the ranks into ``dp x pp``, every schedule offered and every micro-batch count
that splits a replica's share evenly, the model is cut as for that layout alone, and the step and
each rank's peak memory are predicted (:mod:`.layout_cost`). The model is captured once and
profiled once per micro-batch size, which layouts share. The plan chosen lists every candidate it
weighed, with its prediction and why it lost (:attr:`~lightning_antichain.plans.plan.Plan.layouts`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import nn

from ..batches.batch_dims import batch_size_of, first_micro_batch
from ..capture.isolation import keeps_random_state, planned_in_training
from ..measure.cpu_threads import intra_op_threads, stage_threads
from ..plans.layout import Layout
from ..plans.options import PipelineOptions
from ..plans.plan import Plan
from ..plans.process_schedules import SCHEDULE_NAMES, ProcessSchedule, process_schedule
from ..processes.replication import REGATHERS, Regather, Replication
from .cores_shared import contention_of
from .cost_graph import normalize_cost_graph, with_loss, with_times_scaled
from .layout_cost import LayoutCost, Links, gradient_shards, layout_cost
from .overhead import loss_seconds
from .partition import InfeasiblePlanError
from .planning import (
    AUTO,
    Planned,
    _cut,
    _profiled,
    captured_and_checked,
    chunk_candidates,
    default_memory_gb,
    optimizer_multiplier_for,
    profile_cache_dir,
    timed_optimizer_step_s,
)
from .robust_choice import CAPACITY_SPREAD
from .shared_cores import SharedCores
from .target_profile import TargetModel

#: the devices of a layout's stages (its first replica's), under a schedule
DevicesOf = Callable[[Layout, ProcessSchedule], list[torch.device]]

GB = 1e9


def divisors(count: int) -> list[int]:
    return [n for n in range(1, count + 1) if count % n == 0]


@keeps_random_state
def plan_layouts(module: nn.Module, args: tuple, kwargs: dict, world_size: int, devices_of: DevicesOf,
                 search: LayoutSearch, links: Links, options: PipelineOptions, *,
                 optimizers: Sequence[torch.optim.Optimizer] = (), replication: Replication = "ddp",
                 profile_device: torch.device | None = None, shared_cores: SharedCores | None = None,
                 loss: Callable[[Any], torch.Tensor | None] | None = None, alternatives: int = 0,
                 target: TargetModel | None = None) -> Planned:
    """The plan of the fastest layout that fits for batches like the whole batch ``args, kwargs``
    on ``world_size`` ranks (see the module's docstring), with ``plan.layout`` its layout and
    ``plan.layouts`` every candidate. ``profile_device``: where the model is profiled (default:
    the first stage's device), e.g. the CPU, to plan for GPUs this machine does not have.
    ``shared_cores``: the work the ranks, CPU processes on one machine, get through at once in
    units of one alone (:class:`~lightning_antichain.planner.contention.SharedCores`), in place of
    what the profile's two threads suggest. ``loss``: the loss the last stage computes
    from the module's output (a micro-batch's), timed and charged to the output that reads it.
    ``alternatives``: how many of the next layouts predicted fastest come with the plan, each as a
    plan of its own (``Planned.alternatives``), for the ranks to time against it
    (:func:`timeable`). Where none fits, the :class:`InfeasiblePlanError` holds every candidate
    (``layouts``). ``target``: the GPUs the ranks will have, where this machine has none of them:
    each operation costed on their roofline (:mod:`.target_profile`), not profiled."""
    devices = devices_of(Layout(1, world_size), search.schedules[0])
    with planned_in_training(module), intra_op_threads(stage_threads(devices, options.cpu_threads)):
        return _search(module, args, kwargs, world_size, devices_of, search, links, options, optimizers,
                       replication, profile_device or devices[0], shared_cores, loss, alternatives, target)


def _search(module: nn.Module, args: tuple, kwargs: dict, world_size: int, devices_of: DevicesOf,
            search: LayoutSearch, links: Links, options: PipelineOptions,
            optimizers: Sequence[torch.optim.Optimizer], replication: Replication,
            profile_device: torch.device, shared_cores: SharedCores | None,
            loss: Callable[[Any], torch.Tensor | None] | None, alternatives: int,
            target: TargetModel | None = None) -> Planned:
    schedules = search.schedules
    batch_dim = options.batch_dim
    size = batch_size_of(module, args, kwargs, batch_dim)
    if not size:
        raise ValueError('pipeline_parallel_size="auto" needs a batch with samples on its batch dim (batch_dim=) to '
                         "weigh how to split it; give pipeline_parallel_size= as a number instead")
    graph = captured_and_checked(module, args, kwargs, options)
    multiplier = optimizer_multiplier_for(options, optimizers)
    if target is None:
        optimizer_s = timed_optimizer_step_s(module, args, kwargs, optimizers, profile_device)
    else:
        optimizer_s = target.optimizer_step_s(target.trainable_bytes(module), multiplier)
    directory, use_cache = profile_cache_dir(options)
    raw_profiles: dict[int, tuple[nx.DiGraph, str] | Exception] = {}
    profiles: dict[int, tuple[nx.DiGraph, str] | Exception] = {}

    contention = contention_of(shared_cores, loss is not None)

    @functools.cache
    def speed() -> float:
        """The factor the ranks' sharing of the cores scales the profiles by (:mod:`.cores_shared`);
        a replica's share is profiled for it only where the batch splits evenly over them."""
        return 1.0 if size % world_size else contention.speed(lambda: raw(size // world_size))

    def profiled(micro: int) -> tuple[nx.DiGraph, str] | Exception:
        """The profile of micro-batches of ``micro`` samples, its times at the machine's speed when
        the ranks probed it (:func:`~.cores_shared.probe_over_profile`)."""
        if micro not in profiles:
            found = raw(micro)
            profiles[micro] = found if isinstance(found, Exception) or speed() == 1.0 else (
                with_times_scaled(found[0], speed()), found[1])
        return profiles[micro]

    def raw(micro: int) -> tuple[nx.DiGraph, str] | Exception:
        """The profile of micro-batches of ``micro`` samples, as measured (or read from the cache)."""
        if micro not in raw_profiles:
            call = first_micro_batch(module, args, kwargs, size // micro, batch_dim)
            try:
                label = f"{type(module).__name__}, micro-batch {micro}"
                if target is None:
                    cost, _, key = _profiled(module, graph, *call, profile_device, batch_dim, directory, use_cache,
                                             options.progress, label)
                else:
                    cost, key = target.profile(module, graph, *call, batch_dim, options.progress, label), ""
                cost = normalize_cost_graph(cost)  # a copy, complete once for the many cuts of it
                cost.graph.update(optimizer_step_s=optimizer_s, model=type(module).__name__)
                contention.profiled(cost, world_size)
                timed_loss = None if loss is None or target is not None else loss_seconds(module, *call, loss)
                if timed_loss is not None:
                    with_loss(cost, *timed_loss)
                raw_profiles[micro] = (cost, key)
            except (RuntimeError, ValueError) as exc:  # e.g. BatchNorm refuses a single sample in training
                raw_profiles[micro] = exc
        return raw_profiles[micro]

    rows: list[dict[str, Any]] = []
    candidates: list[tuple[Plan, dict[str, Any], nx.DiGraph]] = []
    steps: list[tuple[float, float, float]] = []  # each candidate's, as measured and as the cores vary
    cuts: dict[Hashable, Plan | InfeasiblePlanError] = {}  # schedules of one stage count share their cuts
    for pp in search.pipeline_counts(world_size):
        layout = Layout(world_size // pp, pp)
        for schedule in schedules:
            for row, plan, cost in _weighed(layout, schedule, size, replication, profiled,
                                            lambda cost, layout, schedule, chunks: _candidate(
                                                cost, layout, schedule, chunks, devices_of, links, options,
                                                multiplier, replication, cuts,
                                                contention.optimizer_slowdown(layout, replication, world_size))):
                rows.append(row)
                if plan is None:
                    continue
                candidates.append((plan, row, cost))
                step_of = functools.partial(_step_of, schedule=schedule, layout=layout, links=links,
                                            replication=replication, regather=row.get("regather") or "step")
                spread = contention.spread(plan, step_of, layout, replication, world_size)
                if spread is not None:
                    row["predicted_step_as_cores_vary_s"] = list(spread)
                steps.append((row["predicted_step_s"], *(spread or (row["predicted_step_s"],) * 2)))
    for (_, row, _), regret in zip(candidates, contention.regrets(steps) or ()):
        row["regret_s"] = regret
    best = candidates[contention.best(steps)] if candidates else None
    for row in rows if speed() != 1.0 else ():
        row["profile_scaled_by"] = speed()
    return _chosen(rows, best, world_size, size, graph, candidates, alternatives)


def _step_of(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links, replication: Replication,
             regather: Regather) -> float:
    return layout_cost(plan, schedule, layout, links, replication, regather).step_s


Weigh = Callable[[nx.DiGraph, Layout, ProcessSchedule, int], tuple[Plan, dict[Regather | None, LayoutCost],
                                                                     float | None]]


def regathers(replication: Replication, layout: Layout, schedule: ProcessSchedule) -> tuple[Regather | None, ...]:
    """How often FSDP2 may gather a block's parameters in ``layout`` under ``schedule``: per
    micro-batch or once per step, where replicas shard; once per step only under a schedule that
    takes input and weight gradients apart (:class:`~lightning_antichain.processes.process_pipeline.ProcessPipeline`
    refuses the other); ``None`` where nothing is sharded."""
    if replication != "fsdp" or layout.dp == 1:
        return (None,)
    return ("step",) if schedule.splits_backward else REGATHERS


def _weighed(layout: Layout, schedule: ProcessSchedule, size: int, replication: Replication,
             profiled: Callable[[int], tuple[nx.DiGraph, str] | Exception], weigh: Weigh
             ) -> Iterator[tuple[dict[str, Any], Plan | None, nx.DiGraph | None]]:
    """A row for each micro-batch count of ``layout`` under ``schedule`` for a batch of ``size``
    (and, with FSDP2, for each way to gather: :func:`regathers`), with its plan and cost graph
    where it runs and fits (a row that lost says why)."""
    dp, pp = layout.dp, layout.pp
    base = {"dp": dp, "pp": pp, "schedule": schedule.name, "virtual_stages": schedule.virtual_stages,
            "replication": replication}
    if size % dp:
        yield {**base, "chunks": None, "lost": f"a batch of {size} does not split over {dp} replicas"}, None, None
        return
    share = size // dp
    counts = chunk_candidates(share, schedule.num_stages(pp), even=True)
    if not counts:
        yield {**base, "chunks": None, "lost": f"a share of {share} samples gives each of "
               f"{schedule.num_stages(pp)} stages no micro-batch"}, None, None
    for chunks in counts:
        row = {**base, "chunks": chunks, "micro_batch_size": share // chunks}
        found = profiled(share // chunks)
        if isinstance(found, Exception):
            row["lost"] = f"fails at micro-batches of {share // chunks}: {str(found).splitlines()[0]}"
            yield row, None, None
            continue
        cost, _ = found
        try:
            plan, predicted, limit = weigh(cost, layout, schedule, chunks)
        except (InfeasiblePlanError, ValueError) as exc:
            row["lost"] = str(exc).splitlines()[0]
            if getattr(exc, "needed_bytes", None) is not None:
                row["peak_memory_bytes"], row["limit_bytes"] = exc.needed_bytes, exc.limit_bytes
            yield row, None, None
            continue
        for regather, weighed in predicted.items():
            gathered = {**row, **({} if regather is None else {"regather": regather}),
                        "predicted_step_s": weighed.step_s, "reduction_s": weighed.reduction_s,
                        "optimizer_s": weighed.optimizer_s, "rank_optimizer_s": list(weighed.rank_optimizer_s),
                        "rank_end_s": list(weighed.rank_end_s), "rank_busy_s": list(weighed.rank_busy_s),
                        "peak_memory_bytes": weighed.peak_bytes}
            if weighed.terms is not None:
                gathered.update(terms_s=weighed.terms.seconds, moved_bytes=weighed.terms.moved_bytes,
                                decided_by=weighed.terms.deciding,
                                communication_bound=weighed.terms.communication_bound)
            if limit is not None and weighed.peak_bytes > limit:
                gathered["lost"] = f"needs {weighed.peak_bytes / GB:.1f} GB on a rank, over its {limit / GB:.1f} GB"
                gathered["limit_bytes"] = limit
                yield gathered, None, None
                continue
            yield gathered, plan, cost


def _chosen(rows: list[dict[str, Any]], best: tuple[Plan, dict[str, Any], nx.DiGraph] | None, world_size: int,
            size: int, graph: Any, candidates: Sequence[tuple[Plan, dict[str, Any], nx.DiGraph]] = (),
            alternatives: int = 0) -> Planned:
    """The best layout's plan, with every row weighed and why each other lost, and the plans of
    the first ``alternatives`` layouts the ranks may time against it (:func:`timeable`); a clear
    error where none fits."""
    if best is None:
        reasons = "; ".join(f"dp={r['dp']} x pp={r['pp']} {r['schedule']}: {r['lost']}" for r in rows[:4])
        error = InfeasiblePlanError(f"no layout of {world_size} ranks fits: {reasons}")
        error.layouts = rows
        raise error
    plan, chosen, cost = best
    others = []
    for other, row, _ in timeable(candidates, chosen)[:alternatives]:
        others.append(dataclasses.replace(in_layout(other, row, size), layouts=[]))
    with_verdicts(rows, chosen)
    return Planned(dataclasses.replace(in_layout(plan, chosen, size), layouts=rows), graph, cost,
                   alternatives=tuple(others))


LAYOUT_KEYS = ("dp", "pp", "schedule", "virtual_stages", "replication", "regather")


def in_layout(plan: Plan, row: dict[str, Any], size: int) -> Plan:
    """``plan`` as the plan of the layout of ``row`` (a candidate the search weighed) for batches of ``size``."""
    regather = row.get("regather")
    return dataclasses.replace(
        plan, layout={k: row[k] for k in LAYOUT_KEYS if k in row},
        predicted_step_s=row["predicted_step_s"],  # in its layout
        regather=regather, gradient_shards=gradient_shards(row.get("replication", "ddp"), regather, row["dp"]),
        batch_size=size)


def same_layout(row: dict[str, Any], plan: Plan) -> bool:
    """Whether ``row`` weighed the layout and micro-batch count ``plan`` runs."""
    return row.get("chunks") == plan.chunks and all(row.get(k) == (plan.layout or {}).get(k) for k in LAYOUT_KEYS)


def with_verdicts(rows: list[dict[str, Any]], chosen: dict[str, Any]) -> None:
    """Say in each row that runs and fits why it lost to ``chosen``: its predicted step against
    the chosen's, or, where the ranks timed both, their measured steps. A row that does not run or
    fit keeps its reason."""
    for row in rows:
        if row is chosen:
            row.pop("lost", None)
            row.pop("outrun", None)
            continue
        if "lost" in row and not row.get("outrun"):
            continue
        row["outrun"] = True
        if "measured_step_s" in row and "measured_step_s" in chosen:
            ours, theirs = row["measured_step_s"], chosen["measured_step_s"]
            row["lost"] = (f"timed {'faster' if ours < theirs else 'slower'}: {1e3 * ours:.1f} ms against "
                           f"{1e3 * theirs:.1f} ms (predicted {1e3 * row['predicted_step_s']:.1f} against "
                           f"{1e3 * chosen['predicted_step_s']:.1f})")
            continue
        ours, theirs = row["predicted_step_s"], chosen["predicted_step_s"]
        verdict = "faster" if ours < theirs else "slower" if ours > theirs else "no faster"
        row["lost"] = f"{verdict}: {1e3 * ours:.1f} ms against {1e3 * theirs:.1f} ms"
        if "regret_s" in row and "regret_s" in chosen and ours <= theirs:
            row["lost"] += (f", but up to {1e3 * row['regret_s']:.1f} ms behind the best where the ranks share the "
                            f"cores {CAPACITY_SPREAD:.0%} worse or better (the chosen: "
                            f"{1e3 * chosen['regret_s']:.1f} ms)")


def timeable(candidates: Sequence[tuple[Plan, dict[str, Any], nx.DiGraph]], chosen: dict[str, Any]
             ) -> list[tuple[Plan, dict[str, Any], nx.DiGraph]]:
    """The candidates other than ``chosen`` that the ranks may time against it: first each other
    layout of replicas x stages at its fastest predicted (what a trial tells most about), fastest
    first, then the other schedules and micro-batch counts, each once; none where ``chosen`` is
    sharded by FSDP2, and none sharded (``fully_shard`` shards the user's modules in place, which
    only the layout kept may do)."""
    if chosen.get("regather") is not None:
        return []
    ranked = [c for c in sorted(candidates, key=lambda c: c[1]["predicted_step_s"]) if c[1].get("regather") is None]
    runs, layouts = {_key(chosen)}, {_layout_of(chosen)}
    found = []
    for candidate in ranked:  # each other layout at its best
        if _layout_of(candidate[1]) not in layouts:
            layouts.add(_layout_of(candidate[1]))
            runs.add(_key(candidate[1]))
            found.append(candidate)
    for candidate in ranked:  # then the rest, each run once
        if _key(candidate[1]) not in runs:
            runs.add(_key(candidate[1]))
            found.append(candidate)
    return found


def _layout_of(row: dict[str, Any]) -> tuple:
    return row.get("dp"), row.get("pp")


def _key(row: dict[str, Any]) -> tuple:
    """What a layout runs: one stage per rank runs its micro-batches in the same order under any schedule."""
    alone = row.get("pp") == 1 and row.get("virtual_stages", 1) == 1
    return tuple(None if alone and k == "schedule" else row.get(k) for k in (*LAYOUT_KEYS, "chunks"))


def _candidate(cost: nx.DiGraph, layout: Layout, schedule: ProcessSchedule, chunks: int, devices_of: DevicesOf,
               links: Links, options: PipelineOptions, multiplier: float, replication: Replication,
               cuts: dict[Hashable, Plan | InfeasiblePlanError] | None = None, slowdown: float | None = None
               ) -> tuple[Plan, dict[Regather | None, LayoutCost], float | None]:
    """The plan of ``layout`` under ``schedule`` at ``chunks`` micro-batches, its cost there for
    each way FSDP2 may gather (:func:`regathers`), and the memory of a rank's device in bytes
    (``None``: unlimited). ``slowdown``: the ranks' optimizer steps all at once against one alone
    (:func:`optimizer_slowdown`)."""
    schedule.table(layout.pp, chunks)  # a count torch's schedule refuses raises here
    devices = devices_of(layout, schedule)
    device_gb = default_memory_gb(devices) if options.memory_gb is None else _per_device(options.memory_gb,
                                                                                          len(devices))
    budgets = [None if gb is None else gb / schedule.virtual_stages for gb in device_gb]
    known = [gb for gb in device_gb if gb is not None]
    family = "gpipe" if schedule.name == "gpipe" else "1f1b"
    cuts = {} if cuts is None else cuts

    def cut(limits: list[float | None]) -> Plan:
        key = (id(cost), tuple(map(str, devices)), chunks, family, tuple(limits))
        if key not in cuts:
            try:
                cuts[key] = _cut(cost, devices, chunks, options.recompute, None, options.method, links.within_gbps,
                                 limits, multiplier, family, options.accumulate_grad_batches)
            except InfeasiblePlanError as exc:
                cuts[key] = InfeasiblePlanError(*exc.args)  # without its traceback: the DP's tables stay freed
                cuts[key].needed_bytes, cuts[key].limit_bytes = exc.needed_bytes, exc.limit_bytes
        found = cuts[key]
        if isinstance(found, InfeasiblePlanError):
            raise found
        return found

    try:
        plan = cut(budgets)
    except InfeasiblePlanError:
        if replication != "fsdp" or layout.dp == 1:
            raise
        # sharding over the replicas may fit what a stage whole does not: cut without a budget
        # (None per device; None alone would mean the devices' own memory), FSDP2's peak is weighed below
        plan = cut([None] * len(devices))
    if slowdown is not None:
        plan = dataclasses.replace(plan, optimizer_slowdown=slowdown)
    costs = {regather: layout_cost(plan, schedule, layout, links, replication, regather or "step")
             for regather in regathers(replication, layout, schedule)}
    return plan, costs, min(known) * GB if known else None


def chosen_regather(plan: Plan, schedule: ProcessSchedule, layout: Layout, links: Links, replication: Replication,
                    devices: Sequence[torch.device], memory_gb: float | tuple[float | None, ...] | None
                    ) -> Regather | None:
    """For a plan in a layout given: how FSDP2 gathers (:func:`regathers`), the fastest way that
    fits the devices' memory (``memory_gb``, else what they have), else the one needing the least;
    ``None`` where nothing is sharded."""
    options = regathers(replication, layout, schedule)
    if options == (None,):
        return None
    device_gb = default_memory_gb(devices) if memory_gb is None else _per_device(memory_gb, len(devices))
    known = [gb for gb in device_gb if gb is not None]
    limit = min(known) * GB if known else None
    costs = {r: layout_cost(plan, schedule, layout, links, replication, r) for r in options if r is not None}
    fitting = [r for r, c in costs.items() if limit is None or c.peak_bytes <= limit]
    if fitting:
        return min(fitting, key=lambda r: (costs[r].step_s, costs[r].peak_bytes))
    return min(costs, key=lambda r: costs[r].peak_bytes)


def _per_device(memory_gb: float | tuple[float | None, ...], count: int) -> list[float | None]:
    return list(memory_gb) if isinstance(memory_gb, tuple) else [memory_gb] * count



@dataclass(frozen=True)
class LayoutSearch:
    """What ``pipeline_parallel_size="auto"`` or ``schedule="auto"`` leaves to the planner: the processes per
    pipeline (``None``: every divisor of the ranks) and the schedules to weigh."""

    pipeline_ranks: int | None
    schedules: tuple[ProcessSchedule, ...]

    def pipeline_counts(self, world_size: int) -> list[int]:
        if self.pipeline_ranks is None:
            return sorted(divisors(world_size), reverse=True)
        return [self.pipeline_ranks]


def layout_search(stages: int | str | None, schedule: str, virtual_stages: int | None) -> LayoutSearch | None:
    """The search the strategy's ``stages`` and ``schedule`` ask for, or ``None`` where both are fixed."""
    if stages != AUTO and schedule != AUTO:
        return None
    schedules = tuple(process_schedule(name, virtual_stages if name in ("interleaved-1f1b", "zb-h1") else None)
                      for name in SCHEDULE_NAMES) if schedule == AUTO else (process_schedule(schedule, virtual_stages),)
    return LayoutSearch(None if stages in (AUTO, None) else int(stages), schedules)
