"""Cut a cost graph into pipeline stages.

:func:`partition` with ``method="antichain"`` is the method of the paper: a dynamic program over the
down-set states of :mod:`lightning_antichain.planner.antichain` that minimises the bottleneck stage time,
where a stage costs its compute (forward + backward, divided by its device's speed) plus shipping
its input and output cuts both ways over the link, subject to each device's memory. Devices that
differ are matched to stages by the same program: its state counts how many devices of each kind
are used, so the assignment is optimal too. Among splits with the optimal bottleneck it takes the
one with the least total transfer.

The baselines are contiguous splits of the execution order, evaluated with the same cost model:

* ``"uniform"``: equal operation counts;
* ``"parameters"``: balanced parameter bytes (DeepSpeed's default ``partition_method``);
* ``"blocks"``: the top-level children as blocks, balanced by time (torchgpipe's
  ``balance_by_time``), split into their own children while there are fewer blocks than stages.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import networkx as nx
import numpy as np

from ..runtime.options import PLANNING_METHODS, renamed_recompute
from ..runtime.plan import RECOMPUTE_MODES, Plan, Stage
from .antichain import DEFAULT_MAX_STATES, StateSpace, build_state_space
from .cost_graph import node_compute, normalize_cost_graph, ordered_nodes, total_compute

METHODS = PLANNING_METHODS


class InfeasiblePlanError(ValueError):
    """No split satisfies the request; the message names the limit and the stage."""


@dataclass(frozen=True)
class DeviceSpec:
    """A device a stage can run on: relative ``speed`` (2.0 = twice as fast) and memory in bytes."""

    name: str = "cpu"
    speed: float = 1.0
    memory_bytes: float | None = None


@dataclass(frozen=True)
class CostModel:
    """How a set of operations turns into stage time and memory.

    ``bandwidth`` is bytes per second between neighbouring stages (``inf``: free transfers, as
    between CPU devices that share memory). ``optimizer_multiplier`` is optimizer state per
    parameter byte: 0 for SGD, 1 for SGD with momentum, 2 for Adam.
    """

    chunks: int = 1
    bandwidth: float = math.inf
    optimizer_multiplier: float = 2.0
    recompute: str = "never"

    def transfer_s(self, nbytes: float | np.ndarray) -> Any:
        """Seconds to ship ``nbytes`` forward and its gradient back."""
        return 2.0 * nbytes / self.bandwidth

    def memory_bytes(self, params: Any, buffers: Any, activations: Any, inputs: Any) -> Any:
        """A stage's peak: parameters with their gradients and optimizer state, buffers, and what it
        keeps for backward. Without recomputation that is every micro-batch's ``activations``
        (inputs included), at the end of the forward pass. With it, the peak comes at the first
        backward, which recomputes one micro-batch's activations while the others keep only their
        ``inputs``; ``"except_last"`` and ``"always"`` meet the same peak there."""
        recomputes = self.recompute != "never" and self.chunks > 1
        held = inputs * (self.chunks - 1) + activations if recomputes else activations * self.chunks
        return params * (2.0 + self.optimizer_multiplier) + buffers + held


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
    colocate_tied: bool | None = None,
    recompute: str = "never",
    checkpoint: str | None = None,
) -> Plan:
    """Split the profiled model into ``stages`` pipeline stages and predict what it will cost.

    ``devices`` names the device of each stage slot (default ``cpu``) or gives :class:`DeviceSpec`
    objects; ``speeds`` and ``memory_gb`` (decimal GB, one value or one per device) override their
    speed and memory. ``bandwidth_gbps`` is the link between stages in GB/s; ``None`` means
    transfers are free. ``chunks`` is the number of micro-batches per step; the cost graph's times
    are per micro-batch. ``colocate_tied`` keeps operations that use the same parameter (tied
    weights) in one stage; by default it does so when the stages are on different devices, since
    a parameter lives on one device. ``recompute`` is the runtime's recompute mode, which sets the
    activations a stage holds (see :meth:`CostModel.memory_bytes`). Raises
    :class:`InfeasiblePlanError` when no split fits.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be at least 1, got stages={stages}, chunks={chunks}")
    started = time.perf_counter()
    graph = normalize_cost_graph(cost_graph)
    specs = _device_specs(stages, devices, speeds, memory_gb)
    bandwidth = math.inf if bandwidth_gbps is None else bandwidth_gbps * 1e9
    if bandwidth <= 0:
        raise ValueError(f"bandwidth_gbps must be positive, got {bandwidth_gbps}")
    model = CostModel(chunks, bandwidth, optimizer_multiplier, _checked_mode(renamed_recompute(recompute, checkpoint)))
    free = [v for v in ordered_nodes(graph) if not graph.nodes[v]["pinned"]]
    if len(free) < stages:
        raise InfeasiblePlanError(
            f"cannot cut {len(free)} operations into {stages} stages; ask for at most {len(free)} stages"
        )
    compression: list[str] = []
    num_states = len(free) + 1
    if method == "antichain":
        space = build_state_space(graph, max_states)
        if colocate_tied is None:
            colocate_tied = len({s.name for s in specs}) > 1
        groups = tied_groups(graph) if colocate_tied else []
        for group in groups + [set(g) for g in graph.graph.get("together", [])]:
            space.forbidden = space.forbidden | space.splits(group)
        try:
            chain, order = solve_bottleneck(space, specs, model)
        except InfeasiblePlanError as exc:
            if groups:
                names = "; ".join(", ".join(sorted(map(str, g))) for g in groups)
                raise InfeasiblePlanError(
                    f"{exc}. Tied parameters must stay in one stage when stages are on different devices, and "
                    f"these operations share parameters: {names}. Use fewer stages, or untie the weights."
                ) from exc
            raise
        stage_nodes = _stage_nodes_of_chain(space, chain)
        specs = order
        compression, num_states = space.compression, len(space)
    else:
        stage_nodes = _baseline(graph, free, stages, method)
        pinned = [v for v in ordered_nodes(graph) if graph.nodes[v]["pinned"]]
        stage_nodes[0] = pinned + stage_nodes[0]
    built = evaluate_stages(graph, stage_nodes, specs, model)
    return _make_plan(graph, built, specs, model, method, time.perf_counter() - started, num_states, compression)


def plan_from_balance(
    cost_graph: nx.DiGraph,
    balance: Sequence[int],
    *,
    chunks: int = 1,
    devices: Sequence[str | DeviceSpec] | None = None,
    bandwidth_gbps: float | None = None,
    optimizer_multiplier: float = 2.0,
    recompute: str = "never",
    checkpoint: str | None = None,
) -> Plan:
    """A plan that puts ``balance[k]`` consecutive operations (in execution order) on stage k.

    For users who know the split they want (torchgpipe's ``balance``); the plan still reports the
    predicted costs. The counts must be positive and add up to the number of operations.
    """
    started = time.perf_counter()
    graph = normalize_cost_graph(cost_graph)
    free = [v for v in ordered_nodes(graph) if not graph.nodes[v]["pinned"]]
    if any(b < 1 for b in balance) or sum(balance) != len(free):
        raise InfeasiblePlanError(
            f"balance {list(balance)} must be positive counts adding up to the model's {len(free)} operations"
        )
    specs = _device_specs(len(balance), devices, None, None)
    bandwidth = math.inf if bandwidth_gbps is None else bandwidth_gbps * 1e9
    model = CostModel(chunks, bandwidth, optimizer_multiplier, _checked_mode(renamed_recompute(recompute, checkpoint)))
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
    return _make_plan(graph, built, specs, model, "balance", time.perf_counter() - started, len(free) + 1, [])


def _checked_mode(recompute: str) -> str:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    return recompute


def _device_specs(
    stages: int,
    devices: Sequence[str | DeviceSpec] | None,
    speeds: Sequence[float] | None,
    memory_gb: float | Sequence[float | None] | None,
) -> list[DeviceSpec]:
    names = list(devices) if devices is not None else ["cpu"] * stages
    if len(names) != stages:
        raise ValueError(f"got {len(names)} devices for {stages} stages; give one device per stage")
    specs = [d if isinstance(d, DeviceSpec) else DeviceSpec(str(d)) for d in names]
    if speeds is not None:
        if len(speeds) != stages or any(s <= 0 for s in speeds):
            raise ValueError(f"speeds needs {stages} positive values, got {list(speeds)}")
        specs = [DeviceSpec(d.name, float(s), d.memory_bytes) for d, s in zip(specs, speeds, strict=False)]
    if memory_gb is not None:
        limits = [memory_gb] * stages if isinstance(memory_gb, (int, float)) else list(memory_gb)
        if len(limits) != stages:
            raise ValueError(f"memory_gb needs one value or {stages}, got {len(limits)}")
        specs = [
            DeviceSpec(d.name, d.speed, None if m is None else float(m) * 1e9)
            for d, m in zip(specs, limits, strict=False)
        ]
    return specs


def stage_costs(space: StateSpace, spec: DeviceSpec, model: CostModel) -> np.ndarray:
    """``T[j, i]``: time of the stage ``D_j minus D_i`` on ``spec``; ``inf`` if not a valid stage.

    Valid means ``D_i`` is a strict subset of ``D_j`` and the stage fits the device's memory.
    """
    compute = (space.compute[:, None] - space.compute[None, :]) / spec.speed
    transfer = model.transfer_s(space.cut_bytes[:, None] + space.cut_bytes[None, :])
    valid = space.contains() & ~space.forbidden[:, None] & ~space.forbidden[None, :]
    cost = np.where(valid, compute + transfer, np.inf)
    if spec.memory_bytes is not None:
        memory = _stage_memory(space, model)
        cost[memory > spec.memory_bytes] = np.inf
    return cost


def _stage_memory(space: StateSpace, model: CostModel) -> np.ndarray:
    """Every stage's peak, from additive quantities: with counted saved tensors, what its operations
    made and something keeps, plus both its cuts (a cut tensor that is also kept counts twice); else
    every output and the input cut. Never below :func:`evaluate_stages`'s exact count but for views."""
    diff = lambda a: a[:, None] - a[None, :]  # noqa: E731
    inputs = np.broadcast_to(space.cut_bytes[None, :], (len(space), len(space)))
    activations = diff(space.activation_bytes) + inputs
    if space.graph.graph.get("saved_counted"):
        activations = activations + space.cut_bytes[:, None]
    return model.memory_bytes(diff(space.param_bytes), diff(space.buffer_bytes), activations, inputs)


def solve_bottleneck(
    space: StateSpace, specs: Sequence[DeviceSpec], model: CostModel
) -> tuple[list[int], list[DeviceSpec]]:
    """The chain of states and the device order that minimise the slowest stage.

    The program runs over (devices used of each kind, state) pairs; a step appends one stage
    ``D_j minus D_i`` on a device of one kind. A second pass, with the bottleneck fixed, picks the
    split with the least total stage time (so the least transfer) among the optimal ones.
    """
    kinds = list(dict.fromkeys((s.speed, s.memory_bytes) for s in specs))
    counts = tuple(sum(1 for s in specs if (s.speed, s.memory_bytes) == k) for k in kinds)
    costs = [stage_costs(space, DeviceSpec("", *k), model) for k in kinds]
    last = len(space) - 1
    start = np.full(len(space), np.inf)
    start[0] = 0.0

    bottleneck = _run_program(costs, counts, start, combine=np.maximum)
    best = bottleneck[counts][0][last]
    if not math.isfinite(best):
        raise _infeasible(space, specs, model)
    ceiling = best * (1 + 1e-9) + 1e-15
    capped = [np.where(c <= ceiling, c, np.inf) for c in costs]
    total = _run_program(capped, counts, start, combine=np.add)
    chain, kind_order = _backtrack(total, counts, last)
    pools = {k: [s for s in specs if (s.speed, s.memory_bytes) == k] for k in kinds}
    ordered = [pools[kinds[k]].pop(0) for k in kind_order]
    return chain, ordered


Table = dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _run_program(costs: list[np.ndarray], counts: tuple[int, ...], start: np.ndarray, combine: Any) -> Table:
    """``best[u][j]``: the best value of a chain ending at state j using ``u[k]`` devices of kind k."""
    table: Table = {tuple(0 for _ in counts): (start, np.zeros(len(start), int), np.zeros(len(start), int))}
    for used in sorted(product(*(range(c + 1) for c in counts)), key=sum):
        if sum(used) == 0:
            continue
        value = np.full(len(start), np.inf)
        back = np.zeros(len(start), int)
        kind = np.zeros(len(start), int)
        for k, n in enumerate(used):
            if n == 0:
                continue
            prev = table[used[:k] + (n - 1,) + used[k + 1 :]][0]
            options = combine(costs[k], prev[None, :])
            choice = options.argmin(axis=1)
            candidate = options[np.arange(len(start)), choice]
            better = candidate < value
            value[better], back[better], kind[better] = candidate[better], choice[better], k
        table[used] = (value, back, kind)
    return table


def _backtrack(table: Table, counts: tuple[int, ...], last: int) -> tuple[list[int], list[int]]:
    chain, kinds, used, state = [last], [], counts, last
    while sum(used) > 0:
        _, back, kind = table[used]
        k = int(kind[state])
        kinds.append(k)
        state = int(back[state])
        used = used[:k] + (used[k] - 1,) + used[k + 1 :]
        chain.append(state)
    chain.reverse()
    kinds.reverse()
    return chain[1:], kinds


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


def _stage_nodes_of_chain(space: StateSpace, chain: Sequence[int]) -> list[list[Any]]:
    """The operations of each stage of a chain of states; pinned inputs go to the first stage."""
    sets, before = [], set()
    for j in chain:
        inside = space.down_set(j)
        sets.append([v for v in inside if v not in before])
        before = set(inside)
    return sets


def _infeasible(space: StateSpace, specs: Sequence[DeviceSpec], model: CostModel) -> InfeasiblePlanError:
    """Explain why no chain exists: too few states, or which stage exceeds which memory limit."""
    graph = space.graph
    free = [v for v in space.nodes if not graph.nodes[v]["pinned"]]
    limits = [s.memory_bytes for s in specs if s.memory_bytes is not None]
    if not limits:
        return InfeasiblePlanError(f"cannot cut these {len(free)} operations into {len(specs)} stages")
    largest_limit = max(limits)
    for v in free:
        alone = _memory_of(graph, [v], model)
        if alone > largest_limit:
            return InfeasiblePlanError(
                f"operation {v!r} alone needs {alone / 1e9:.3g} GB (parameters, gradients, optimizer "
                f"state and {model.chunks} micro-batches of activations), more than the largest device "
                f"memory limit of {largest_limit / 1e9:.3g} GB; no stage containing it can fit"
            )
    unlimited = [DeviceSpec(s.name, s.speed, None) for s in specs]
    chain, order = solve_bottleneck(space, unlimited, model)
    built = evaluate_stages(graph, _stage_nodes_of_chain(space, chain), order, model)
    worst = max(built, key=lambda st: st.memory_bytes)
    listed = ", ".join(f"{m / 1e9:.3g}" for m in limits)
    return InfeasiblePlanError(
        f"no split into {len(specs)} stages fits the memory limits ({listed} GB): the fastest split "
        f"without limits needs {worst.memory_bytes / 1e9:.3g} GB on stage {worst.index} "
        f"({len(worst.nodes)} ops, {worst.nodes[0]} .. {worst.nodes[-1]}: "
        f"{worst.param_bytes / 1e9:.3g} GB parameters, {worst.activation_bytes / 1e9:.3g} GB activations "
        "per micro-batch), and no other split brings every stage under its limit. Give more memory or "
        "more stages, fewer micro-batches (chunks), or a smaller optimizer_multiplier."
    )


def _memory_of(graph: nx.DiGraph, nodes: list[Any], model: CostModel) -> float:
    attr = lambda key: sum(graph.nodes[v][key] for v in nodes)  # noqa: E731
    cut_in = list(dict.fromkeys(p for v in nodes for p in graph.predecessors(v) if p not in nodes))
    activations, inputs = kept_bytes(graph, nodes, cut_in, nodes)
    return model.memory_bytes(attr("param_bytes"), attr("buffer_bytes"), activations, inputs)


def kept_bytes(graph: nx.DiGraph, nodes: Sequence[Any], cut_in: Sequence[Any], cut_out: Sequence[Any]
               ) -> tuple[int, int]:
    """What a stage keeps per micro-batch for backward, and what it keeps of a recomputed one.

    With counted saved tensors: the union of the storages its operations save and of its input and
    output cuts' storages (each storage once), the copies of the inputs it changes in place (the
    runtime changes a copy), and the input cuts' storages. Otherwise: every output of its
    operations and its input cut, and the input cut.
    """
    if graph.graph.get("saved_counted"):
        inputs = {k: b for v in cut_in for k, b in graph.nodes[v]["storages"].items()}
        kept = dict(inputs)
        for v in nodes:
            kept.update(graph.nodes[v]["saved"])
        for v in cut_out:
            kept.update(graph.nodes[v]["storages"])
        changed = {k for v in nodes for k in graph.nodes[v].get("mutates", ())} & set(inputs)
        return sum(kept.values()) + sum(inputs[k] for k in changed), sum(inputs.values())
    in_bytes = sum(graph.nodes[v]["output_bytes"] for v in cut_in)
    own = sum(graph.nodes[v]["output_bytes"] for v in nodes if not graph.nodes[v]["pinned"])
    return own + in_bytes, in_bytes


def evaluate_stages(
    graph: nx.DiGraph, stage_nodes: Sequence[Sequence[Any]], specs: Sequence[DeviceSpec], model: CostModel
) -> list[Stage]:
    """Cost each stage of a split directly from the graph (the program's arrays are not used).

    A stage's input cut is every node before it whose output is still needed at or after it; its
    output cut is every node up to it whose output is still needed after it. Tensors that skip a
    stage are relayed through it, so they count in both of its cuts.
    """
    outputs = set(graph.graph.get("outputs", []))
    seen: set[Any] = {v for v in graph.nodes if graph.nodes[v]["pinned"]}
    built: list[Stage] = []

    def cut(inside: set[Any]) -> list[Any]:
        return [
            v
            for v in ordered_nodes_of(graph, inside)
            if v in outputs or any(s not in inside for s in graph.successors(v))
        ]

    cut_in = cut(set(seen))
    for k, (nodes, spec) in enumerate(zip(stage_nodes, specs, strict=False)):
        seen |= set(nodes)
        if not any(not graph.nodes[v]["pinned"] for v in nodes):
            raise InfeasiblePlanError(f"stage {k} is empty")
        for v in nodes:
            missing = [p for p in graph.predecessors(v) if p not in seen]
            if missing:
                raise InfeasiblePlanError(f"stage {k} runs {v!r} before its inputs {missing} are computed")
        cut_out = cut(seen)
        in_bytes = sum(graph.nodes[v]["output_bytes"] for v in cut_in)
        out_bytes = sum(graph.nodes[v]["output_bytes"] for v in cut_out)
        sum_attr = lambda key: sum(graph.nodes[v][key] for v in nodes if not graph.nodes[v]["pinned"])  # noqa: E731,B023
        activations, kept_inputs = kept_bytes(graph, nodes, cut_in, cut_out)
        built.append(
            Stage(
                index=k,
                device=spec.name,
                nodes=[str(v) for v in nodes],
                forward_s=sum_attr("forward_s") / spec.speed,
                backward_s=sum_attr("backward_s") / spec.speed,
                transfer_s=float(model.transfer_s(in_bytes + out_bytes)),
                memory_bytes=int(model.memory_bytes(sum_attr("param_bytes"), sum_attr("buffer_bytes"), activations,
                                                    kept_inputs)),
                param_bytes=int(sum_attr("param_bytes")),
                buffer_bytes=int(sum_attr("buffer_bytes")),
                activation_bytes=int(activations),
                input_bytes=int(in_bytes),
                kept_input_bytes=int(kept_inputs),
                output_bytes=int(out_bytes),
                inputs=[str(v) for v in cut_in],
                outputs=[str(v) for v in cut_out],
                speed=spec.speed,
                memory_limit_bytes=None if spec.memory_bytes is None else int(spec.memory_bytes),
            )
        )
        cut_in = cut_out
    return built


def ordered_nodes_of(graph: nx.DiGraph, nodes: set[Any]) -> list[Any]:
    return sorted(nodes, key=lambda v: graph.nodes[v]["order"])


def _make_plan(
    graph: nx.DiGraph,
    stages: list[Stage],
    specs: Sequence[DeviceSpec],
    model: CostModel,
    method: str,
    solve_s: float,
    num_states: int,
    compression: list[str],
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
        num_nodes=sum(1 for v in graph.nodes if not graph.nodes[v]["pinned"]),
        num_states=num_states,
        solve_s=solve_s,
        profile_s=meta.get("profile_s"),
        compression=list(compression),
        model=meta.get("model"),
        granularity=meta.get("granularity"),
        frontend=meta.get("frontend"),
        refused=list(meta.get("refused") or []),
        profiled_on=meta.get("device_name") or meta.get("device"),
        task_overhead_s=float(meta.get("task_overhead_s") or 0.0),
        step_overhead_s=float(meta.get("step_overhead_s") or 0.0),
        optimizer_step_s=float(meta.get("optimizer_step_s") or 0.0),
        parallel_capacity=meta.get("parallel_capacity"),
        cpu_cores=meta.get("cpu_cores"),
    )
    plan.predicted_step_s = plan.predict_step()
    return plan


def _baseline(graph: nx.DiGraph, free: list[Any], stages: int, method: str) -> list[list[Any]]:
    if method == "uniform":
        return [list(part) for part in np.array_split(np.array(free, dtype=object), stages)]
    if method == "parameters":
        weights = [float(graph.nodes[v]["param_bytes"]) for v in free]
        return [[free[i] for i in part] for part in _contiguous_min_max(weights, stages)]
    blocks = _top_level_blocks(graph, free, stages)
    weights = [sum(node_compute(graph, v) for v in block) for block in blocks]
    return [[v for i in part for v in blocks[i]] for part in _contiguous_min_max(weights, stages)]


def _top_level_blocks(graph: nx.DiGraph, free: list[Any], stages: int) -> list[list[Any]]:
    """Runs of consecutive operations with the same top-level owner; split deeper while too few."""
    depth = 1
    while True:
        blocks: list[list[Any]] = []
        key = None
        for v in free:
            owner = graph.nodes[v].get("owner") or ""
            parts = owner.split(".") if owner else [str(v)]
            this = ".".join(parts[:depth]) if owner else str(v)
            if blocks and this == key:
                blocks[-1].append(v)
            else:
                blocks.append([v])
                key = this
        deepest = max((len((graph.nodes[v].get("owner") or "").split(".")) for v in free), default=1)
        if len(blocks) >= stages or depth > deepest:
            if len(blocks) < stages:
                return [[v] for v in free]
            return blocks
        depth += 1


def _contiguous_min_max(weights: Sequence[float], parts: int) -> list[range]:
    """Split a sequence into ``parts`` non-empty runs minimising the heaviest run (exact DP)."""
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((parts + 1, n + 1), np.inf)
    back = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            options = np.maximum(best[k - 1, :j], prefix[j] - prefix[:j])
            i = int(options.argmin())
            best[k, j], back[k, j] = options[i], i
    bounds, j = [n], n
    for k in range(parts, 0, -1):
        j = int(back[k, j])
        bounds.append(j)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]
