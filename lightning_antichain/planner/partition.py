"""Cut a cost graph into pipeline stages: the planner's entry for a given cost graph.

:func:`partition` with ``method="antichain"`` is the method of the paper: the dynamic program of
:mod:`~lightning_antichain.planner.dp` over the down-set states of
:mod:`~lightning_antichain.planner.antichain`, with stages costed by
:mod:`~lightning_antichain.planner.cost_model`. The other methods are the contiguous baselines of
:mod:`~lightning_antichain.planner.baselines`, costed the same way. :func:`plan_from_balance` takes a
split given as operations per stage. Either way the result is a :class:`~lightning_antichain.Plan`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import networkx as nx
import numpy as np

from ..capture.carried import pass_on
from ..plans.options import PLANNING_METHODS
from ..plans.plan import Plan, Stage
from ..plans.schedule import in_flight, make_schedule, runs_in_process
from .antichain import DEFAULT_MAX_STATES, state_space_of_normalized
from .baselines import baseline_split
from .cost_graph import node_compute, normalize_cost_graph, ordered_nodes, total_compute
from .cost_model import CostModel, DeviceSpec, InfeasiblePlanError, checked_mode, device_specs, evaluate_stages
from .dp import coarse_window, solve_coarse_to_fine, stage_nodes_of_chain

METHODS = PLANNING_METHODS


def partition(
    cost_graph: nx.DiGraph,
    stages: int,
    *,
    chunks: int = 1,
    method: str = "antichain",
    devices: Sequence[str | DeviceSpec] | None = None,
    speeds: Sequence[float] | None = None,
    memory_gb: float | Sequence[float | None] | None = None,
    bandwidth_gbps: float | None = None,
    optimizer_multiplier: float = 2.0,
    max_states: int = DEFAULT_MAX_STATES,
    colocate_tied: bool = False,
    recompute: str = "never",
    schedule: str = "gpipe",
    accumulate_grad_batches: int = 1,
) -> Plan:
    """Split the profiled model into ``stages`` pipeline stages and predict what it will cost.

    ``devices`` names the device of each stage slot (default ``cpu``) or gives :class:`DeviceSpec`
    objects; ``speeds`` and ``memory_gb`` (decimal GB, one value or one per device) override their
    speed and memory. ``bandwidth_gbps`` is the link between stages in GB/s; ``None`` means
    transfers are free. ``chunks`` is the number of micro-batches per step; the cost graph's times
    are per micro-batch. ``colocate_tied`` keeps operations that use the same parameter (tied
    weights) in one stage; by default they may be cut apart, since both runtimes give each device
    that uses such a parameter its own copy and sum the copies' gradients.
    ``recompute`` is the runtime's recompute mode, which sets the
    activations a stage holds (see :meth:`CostModel.memory_bytes`). ``schedule`` names the order
    the stages run their tasks in (:data:`~lightning_antichain.plans.schedule.SCHEDULES`): it
    sets the predicted step and how many micro-batches each stage holds (``"1f1b"``: ``K - k`` on
    stage k, which the memory limits are checked against). Raises :class:`InfeasiblePlanError`
    when no split fits.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be at least 1, got stages={stages}, chunks={chunks}")
    started = time.perf_counter()
    graph = normalize_cost_graph(cost_graph, copy=False)
    specs = device_specs(stages, devices, speeds, memory_gb)
    bandwidth = math.inf if bandwidth_gbps is None else bandwidth_gbps * 1e9
    if bandwidth <= 0:
        raise ValueError(f"bandwidth_gbps must be positive, got {bandwidth_gbps}")
    model = CostModel(chunks, bandwidth, optimizer_multiplier, checked_mode(recompute),
                      held_micro_batches(schedule, stages, chunks), *batch_loss_bytes(graph, chunks, schedule),
                      accumulate_s_per_byte=float(graph.graph.get("accumulate_s_per_byte") or 0.0),
                      accumulate_grad_batches=accumulate_grad_batches)
    free = [v for v in ordered_nodes(graph) if not graph.nodes[v]["pinned"]]
    if len(free) < stages:
        raise InfeasiblePlanError(
            f"cannot cut {len(free)} operations into {stages} stages; ask for at most {len(free)} stages"
            + (f". The profile holds only {graph.graph.get('model', 'the model')}'s top-level children, since no "
               f"frontend captured it: {_refusals(graph)}" if graph.graph.get("granularity") == "children" else "")
        )
    compression: list[str] = []
    num_states = len(free) + 1
    if method == "antichain":
        stage_nodes, specs, compression, num_states = _solved(graph, specs, model, max_states, colocate_tied)
    else:
        stage_nodes = baseline_split(graph, free, stages, method)
        pinned = [v for v in ordered_nodes(graph) if graph.nodes[v]["pinned"]]
        stage_nodes[0] = pinned + stage_nodes[0]
    built = evaluate_stages(graph, stage_nodes, specs, model)
    plan = _make_plan(graph, built, specs, model, method, time.perf_counter() - started, num_states, compression,
                      schedule)
    pass_on(cost_graph, plan)
    return plan


def _solved(graph: nx.DiGraph, specs: list[DeviceSpec], model: CostModel, max_states: int, colocate_tied: bool
            ) -> tuple[list[list[Any]], list[DeviceSpec], list[str], int]:
    """The antichain DP's split: each stage's operations, the devices in the order it chose, what
    the state space compressed, and its size."""
    space = state_space_of_normalized(graph, max_states)
    groups = tied_groups(graph) if colocate_tied else []
    for group in groups + [set(g) for g in graph.graph.get("together", [])]:
        space.forbidden = space.forbidden | space.splits(group)
    try:
        chain, order = solve_coarse_to_fine(space, specs, model)
    except InfeasiblePlanError as exc:
        if groups:
            names = "; ".join(", ".join(sorted(map(str, g))) for g in groups)
            raise InfeasiblePlanError(
                f"{exc}. With colocate_tied=True, tied parameters stay in one stage, and these operations "
                f"share parameters: {names}. Use fewer stages, or let the tie be cut (colocate_tied=False)."
            ) from exc
        raise
    compression = list(space.compression)
    width = coarse_window(space)
    if width is not None:
        compression.append(f"{len(space)} prefixes: cut at one in each window of about {width} first, then "
                           "each cut at any prefix between its neighbours' first places")
    return stage_nodes_of_chain(space, chain), order, compression, len(space)


def held_micro_batches(schedule: str, stages: int, chunks: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches ``schedule`` keeps in flight on it; empty where every stage
    holds them all (GPipe), as :class:`CostModel` takes it."""
    held = tuple(in_flight(make_schedule(schedule, stages, chunks)))
    return () if all(n == chunks for n in held) else held


def plan_from_balance(
    cost_graph: nx.DiGraph,
    balance: Sequence[int],
    *,
    chunks: int = 1,
    devices: Sequence[str | DeviceSpec] | None = None,
    bandwidth_gbps: float | None = None,
    optimizer_multiplier: float = 2.0,
    recompute: str = "never",
    memory_gb: float | Sequence[float | None] | None = None,
    schedule: str = "gpipe",
    accumulate_grad_batches: int = 1,
) -> Plan:
    """A plan that puts ``balance[k]`` consecutive operations (in execution order) on stage k.

    For users who know the split they want (torchgpipe's ``balance``); the plan still reports the
    predicted costs. The counts must be positive and add up to the number of operations, or to
    that and the model's inputs, which the first stage holds (as a plan's ``balance`` lists them).
    ``memory_gb`` is recorded as each stage's budget, for the run-time check, not enforced here:
    the split is the user's. ``schedule`` is as for :func:`partition`.
    """
    started = time.perf_counter()
    graph = normalize_cost_graph(cost_graph)
    free = [v for v in ordered_nodes(graph) if not graph.nodes[v]["pinned"]]
    inputs = len(graph) - len(free)
    if inputs and balance and sum(balance) == len(free) + inputs and balance[0] > inputs:  # a plan's balance
        balance = [balance[0] - inputs, *balance[1:]]
    if any(b < 1 for b in balance) or sum(balance) != len(free):
        raise InfeasiblePlanError(
            f"balance {list(balance)} must be positive counts adding up to the model's {len(free)} operations"
        )
    specs = device_specs(len(balance), devices, None, memory_gb)
    bandwidth = math.inf if bandwidth_gbps is None else bandwidth_gbps * 1e9
    model = CostModel(chunks, bandwidth, optimizer_multiplier, checked_mode(recompute),
                      held_micro_batches(schedule, len(balance), chunks), *batch_loss_bytes(graph, chunks, schedule),
                      accumulate_s_per_byte=float(graph.graph.get("accumulate_s_per_byte") or 0.0),
                      accumulate_grad_batches=accumulate_grad_batches)
    bounds = np.cumsum([0, *balance])
    stage_nodes = [free[bounds[k] : bounds[k + 1]] for k in range(len(balance))]
    stage_nodes[0] = [v for v in ordered_nodes(graph) if graph.nodes[v]["pinned"]] + stage_nodes[0]
    for group in graph.graph.get("together", []):
        stages_of = {k for k, members in enumerate(stage_nodes) if set(group) & set(members)}
        if len(stages_of) > 1:
            raise InfeasiblePlanError(
                f"balance {list(balance)} separates {', '.join(group)}, which must share a stage: a view taken "
                "before an in-place change and read after it. Move the boundary before or after them."
            )
    built = evaluate_stages(graph, stage_nodes, specs, model)
    plan = _make_plan(graph, built, specs, model, "balance", time.perf_counter() - started, len(free) + 1, [],
                      schedule)
    pass_on(cost_graph, plan)
    return plan


def tied_groups(graph: nx.DiGraph) -> list[set[Any]]:
    """Sets of operations that read the same parameter (a parameter fetched with ``get_attr`` is
    read by the fetch's consumers, since every stage re-creates its own fetch)."""
    users: dict[str, set[Any]] = {}
    for v in graph.nodes:
        readers = list(graph.successors(v)) if graph.nodes[v].get("kind") == "get_attr" else [v]
        for name in graph.nodes[v].get("uses", []):
            users.setdefault(name, set()).update(readers)
    groups: list[set[Any]] = []
    for members in users.values():
        if len(members) > 1:
            merged = [g for g in groups if g & members]
            for g in merged:
                groups.remove(g)
                members = members | g
            groups.append(set(members))
    return groups


def _make_plan(
    graph: nx.DiGraph,
    stages: list[Stage],
    specs: Sequence[DeviceSpec],
    model: CostModel,
    method: str,
    solve_s: float,
    num_states: int,
    compression: list[str],
    schedule: str = "gpipe",
) -> Plan:
    total = total_compute(graph)
    largest = max(node_compute(graph, v) for v in graph.nodes)
    lower_bound = max(total / sum(s.speed for s in specs), largest / max(s.speed for s in specs))
    meta = graph.graph
    plan = Plan(
        stages=stages,
        method=method,
        chunks=model.chunks,
        bottleneck_s=max(s.time_s for s in stages),
        lower_bound_s=lower_bound,
        predicted_step_s=0.0,
        total_compute_s=total,
        micro_batch_size=meta.get("micro_batch_size"),
        bandwidth_gbps=None if math.isinf(model.bandwidth) else model.bandwidth / 1e9,
        optimizer_multiplier=model.optimizer_multiplier,
        recompute=model.recompute,
        schedule=schedule,
        num_nodes=sum(1 for v in graph.nodes if not graph.nodes[v]["pinned"]),
        num_states=num_states,
        solve_s=solve_s,
        profile_s=meta.get("profile_s"),
        compression=list(compression),
        model=meta.get("model"),
        granularity=meta.get("granularity"),
        frontend=meta.get("frontend"),
        refused=list(meta.get("refused") or []),
        profiled_on=meta.get("cost_source") or meta.get("device_name") or meta.get("device"),
        task_overhead_s=float(meta.get("task_overhead_s") or 0.0),
        step_overhead_s=float(meta.get("step_overhead_s") or 0.0),
        accumulate_s_per_byte=float(meta.get("accumulate_s_per_byte") or 0.0),
        accumulate_grad_batches=model.accumulate_grad_batches,
        optimizer_step_s=float(meta.get("optimizer_step_s") or 0.0),
        parallel_capacity=meta.get("parallel_capacity"),
        cpu_cores=meta.get("cpu_cores"),
        optimizer_slowdown=meta.get("optimizer_slowdown"),
        optimizer_tensor_s=float(meta.get("optimizer_tensor_s") or 0.0),
        repeated_blocks=dict(meta.get("repeated_blocks") or {}),
    )
    return replace(plan, predicted_step_s=plan.predict_step())


def _refusals(graph: nx.DiGraph) -> str:
    refused = graph.graph.get("refused") or []
    return "; ".join(refused) if isinstance(refused, list) else str(refused)


def batch_loss_bytes(graph: nx.DiGraph, chunks: int, schedule: str) -> tuple[float, float]:
    """What the first stage's device holds beside the stage where one process runs the whole
    batch's loss: the micro-batches' outputs joined into the batch's and that output's gradient
    (2 x ``chunks`` x one micro-batch's output), and the loss's workspace at its backward, taken
    as two more of the output (what common losses keep and make: a cross-entropy's log-softmax
    and its gradient, a squared error's square and its gradient); nothing where each
    micro-batch's loss is taken on the last stage (stages as processes)."""
    if not runs_in_process(schedule):
        return 0.0, 0.0
    output = chunks * sum(graph.nodes[v]["output_bytes"] for v in graph.graph.get("outputs", []))
    return 2.0 * output, 2.0 * output
