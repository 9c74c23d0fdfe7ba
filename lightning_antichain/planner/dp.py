"""The dynamic program of the paper: the chain of down-set states that minimises the slowest stage.

It runs over (devices used of each kind, state) pairs, so devices that differ are matched to
stages by the same program; among splits with the optimal bottleneck it takes the one with the
least total transfer. When no chain fits the memory limits it says which stage needs what.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

import numpy as np

from .antichain import StateSpace
from .cost_model import CostModel, DeviceSpec, InfeasiblePlanError, evaluate_stages, memory_of


def stage_times(space: StateSpace, speed: float, model: CostModel, rows: np.ndarray | None = None,
                columns: np.ndarray | None = None) -> np.ndarray:
    """``T[j, i]``: time of the stage ``D_j minus D_i`` on a device of ``speed`` per micro-batch,
    memory aside: its compute, its cuts' transfers and its adding into gradients; ``inf`` where it
    is not a stage. ``rows`` and ``columns``: only those end and start states (default: all)."""
    # both are sums over a down-set, so a stage's is the difference of two states' totals
    work = space.compute / speed + model.accumulation_s(space.param_bytes - space.frozen_bytes)
    ends, starts = _states(space, rows), _states(space, columns)
    compute = work[ends][:, None] - work[starts][None, :]
    transfer = model.transfer_s(space.cut_bytes[ends][:, None] + space.cut_bytes[starts][None, :])
    contains = space.contains() if rows is None and columns is None else space.contains_between(ends, starts)
    valid = contains & ~space.forbidden[ends][:, None] & ~space.forbidden[starts][None, :]
    return np.where(valid, compute + transfer, np.inf)


def _states(space: StateSpace, chosen: np.ndarray | None) -> np.ndarray:
    return np.arange(len(space)) if chosen is None else chosen


def _stage_memory(space: StateSpace, model: CostModel, index: int | None = None, rows: np.ndarray | None = None,
                  columns: np.ndarray | None = None) -> np.ndarray:
    """Every stage's peak, from additive quantities: with counted saved tensors, what its operations
    made and something keeps, plus both its cuts (a cut tensor that is also kept counts twice); else
    every output and the input cut. Never below :func:`evaluate_stages`'s exact count but for views.
    ``rows`` and ``columns``: only those end and start states (default: all)."""
    ends, starts = _states(space, rows), _states(space, columns)
    diff = lambda a: a[ends][:, None] - a[starts][None, :]  # noqa: E731
    inputs = np.broadcast_to(space.cut_bytes[starts][None, :], (len(ends), len(starts)))
    activations = diff(space.activation_bytes) + inputs
    if space.graph.graph.get("saved_counted"):
        activations = activations + space.cut_bytes[ends][:, None]
    first = (starts == 0)[None, :]  # a stage from state 0, the empty down-set, is the first
    return model.memory_bytes(diff(space.param_bytes), diff(space.buffer_bytes), activations, inputs,
                              diff(space.frozen_bytes), index=index, first=first)


def _fitting_chain(space: StateSpace, specs: Sequence[DeviceSpec], model: CostModel) -> list[int] | None:
    """A chain of states whose stages each fit their device, in the devices' order, each stage
    reaching as far as its device holds (leaving a state for each stage after it); ``None`` where
    this finds none. Linear in the states: what the coarse program of :func:`solve_coarse_to_fine`
    is given when its few states hold no chain that fits."""
    chain, state, last = [], 0, len(space) - 1
    after = np.arange(len(space))
    for index, spec in enumerate(specs):
        room = last - (len(specs) - 1 - index)  # the farthest this stage may end
        fits = (after > state) & (after <= room) & ~space.forbidden
        if spec.memory_bytes is not None:
            fits &= _stage_memory(space, model, index, columns=np.array([state]))[:, 0] <= spec.memory_bytes
        if not fits.any() or (index == len(specs) - 1 and not fits[last]):
            return None
        state = last if index == len(specs) - 1 else int(np.flatnonzero(fits)[-1])
        chain.append(state)
    return chain


#: a chain of more states than this is cut coarse to fine (:func:`solve_coarse_to_fine`)
COARSE_STATES = 512
#: how many of the coarse program's windows either side of each of its cuts the fine one reopens
FINE_MARGIN = 2


def coarse_window(space: StateSpace) -> int | None:
    """How many consecutive states the coarse program of :func:`solve_coarse_to_fine` takes one of;
    ``None`` where it runs on every state."""
    if not space.prefixes_only or len(space) <= 2 * COARSE_STATES:
        return None
    return -(-(len(space) - 2) // COARSE_STATES)


def solve_coarse_to_fine(space: StateSpace, specs: Sequence[DeviceSpec], model: CostModel
                         ) -> tuple[list[int], list[DeviceSpec]]:
    """:func:`solve_bottleneck` for a space whose states form one chain (prefixes of the execution
    order): past :data:`COARSE_STATES`, the program first runs on one state per window of
    consecutive states (the one with the smallest cut), then again with each cut free to move to
    any state between where the first run put the cuts either side of it (and :data:`FINE_MARGIN`
    windows further). The program's
    tables grow with the square of the states it may cut at: a 70 B decoder has 5,000 prefixes, a
    405 B one 8,000 cut into up to 128 stages, and a layout search cuts them dozens of times.
    Where no split within those bands fits the memory limits, the second run takes every state
    near any of the cuts."""
    count, width = len(space), coarse_window(space)
    if width is None:
        return solve_bottleneck(space, specs, model)
    cut = np.where(space.forbidden, np.inf, space.cut_bytes)
    picks = [0]
    for start in range(1, count - 1, width):
        window = cut[start:min(start + width, count - 1)]
        picks.append(start + len(window) - 1 - int(np.argmin(window[::-1])))  # the smallest cut, the last of ties
    picks.append(count - 1)
    try:
        chain, _ = solve_bottleneck(space.subset(picks), specs, model)
    except InfeasiblePlanError:
        fitting = _fitting_chain(space, specs, model)  # a split that fits between the coarse states
        if fitting is None:
            raise
        picks = sorted(set(picks) | set(fitting))
        chain, _ = solve_bottleneck(space.subset(picks), specs, model)
    reach = FINE_MARGIN * width
    cuts = [picks[i] for i in chain[:-1]]
    around = [1, *cuts, count - 2]  # each cut ranges between its neighbours' first places
    bands = [np.arange(max(1, around[k] - reach), min(count - 1, around[k + 2] + reach + 1)) for k in range(len(cuts))]
    try:
        return solve_bottleneck(space, specs, model, bands)
    except InfeasiblePlanError:
        near = sorted({0, count - 1}.union(*(band.tolist() for band in bands)))
        chain, order = solve_bottleneck(space.subset(near), specs, model)
        return [near[i] for i in chain], order


def solve_bottleneck(
    space: StateSpace, specs: Sequence[DeviceSpec], model: CostModel, bands: Sequence[np.ndarray] | None = None
) -> tuple[list[int], list[DeviceSpec]]:
    """The chain of states and the device order that minimise the slowest stage.

    The program runs over (devices used of each kind, state) pairs; a step appends one stage
    ``D_j minus D_i`` on a device of one kind. A second pass, with the bottleneck fixed, picks the
    split with the least total stage time (so the least transfer) among the optimal ones.
    ``bands``: per cut between stages (one fewer than ``specs``), the states it may be at; the
    program's tables then hold those states alone. ``None``: any state.
    """
    kinds = list(dict.fromkeys((s.speed, s.memory_bytes) for s in specs))
    counts = tuple(sum(1 for s in specs if (s.speed, s.memory_bytes) == k) for k in kinds)
    last = len(space) - 1
    if bands is not None and len(bands) != len(specs) - 1:
        raise ValueError(f"{len(specs)} stages have {len(specs) - 1} cuts, got bands for {len(bands)}")
    # per stage, the states it may end at, the last stage's the last state
    ends = [None if bands is None else np.asarray(band) for band in (bands or [None] * (len(specs) - 1))]
    ends.append(np.array([last]))
    begins = [np.array([0]), *ends[:-1]]

    def band_of(position: int) -> int | None:
        """Positions whose stages range over the same states share a key (unbanded middle stages)."""
        return None if bands is None and 0 < position < len(specs) - 1 else position

    times: dict[tuple[float, int | None], np.ndarray] = {}

    def times_of(speed: float, position: int) -> np.ndarray:
        key = (speed, band_of(position))
        if key not in times:
            times[key] = stage_times(space, speed, model, ends[position], begins[position])
        return times[key]

    # one held count's cost arrays at a time: a stage of a 1F1B pipeline of p stages holds p - i
    # micro-batches, each count an array of states x states; all of them at once took 23 GB for
    # a 405 B decoder in 64 stages. The program visits the stages in order, so each is made once a pass.
    made: dict[tuple[int, int, bool, int | None], np.ndarray] = {}

    def held_costs(kind: int, position: int, ceiling: float | None) -> np.ndarray:
        key = (model.held_by(position), kind, ceiling is not None, band_of(position))
        if key not in made:
            if any(k[0] != key[0] for k in made):
                made.clear()
            limit = kinds[kind][1]
            found = times_of(kinds[kind][0], position)
            if limit is not None:
                found = np.where(memory_holding(key[0], position) > limit, np.inf, found)
            made[key] = found if ceiling is None else np.where(found <= ceiling, found, np.inf)
        return made[key]

    memories: dict[tuple[int | None, int], np.ndarray] = {}

    def memory_holding(count: int, position: int) -> np.ndarray:
        """Every stage's peak as a stage holding ``count`` micro-batches. Past two counts of two or
        more, the peak is affine in the count (what a micro-batch keeps, or its input where it
        recomputes, once more a micro-batch), so the rest follow from those two without the
        program's arrays being made again for each of a long pipeline's stages."""
        band = band_of(position)
        if (band, count) in memories:
            return memories[band, count]
        known = sorted(c for b, c in memories if b == band and c >= 2)
        if count >= 2 and len(known) >= 2:
            low, high = memories[band, known[0]], memories[band, known[1]]
            return low + (count - known[0]) * (high - low) / (known[1] - known[0])
        memories[band, count] = _stage_memory(space, model, _index_holding(model, count), ends[position],
                                              begins[position])
        return memories[band, count]

    start = np.zeros(1)  # the empty chain, at state 0
    bottleneck = _run_program(lambda kind, position: held_costs(kind, position, None), counts, start,
                              combine=np.maximum)
    best = bottleneck[counts][0][0]
    if not math.isfinite(best):
        raise _infeasible(space, specs, model)
    ceiling = best * (1 + 1e-9) + 1e-15
    made.clear()
    total = _run_program(lambda kind, position: held_costs(kind, position, ceiling), counts, start, combine=np.add)
    full = np.arange(len(space))
    chain, kind_order = _backtrack(total, counts, [full if band is None else band for band in ends])
    pools = {k: [s for s in specs if (s.speed, s.memory_bytes) == k] for k in kinds}
    ordered = [pools[kinds[k]].pop(0) for k in kind_order]
    return chain, ordered


Table = dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _index_holding(model: CostModel, count: int) -> int | None:
    """A stage index that holds ``count`` micro-batches (``None`` where every stage holds ``chunks``)."""
    return None if not model.held else model.held.index(count)


def _run_program(costs: Callable[[int, int], np.ndarray], counts: tuple[int, ...], start: np.ndarray,
                 combine: Any) -> Table:
    """``best[u][j]``: the best value of a chain ending at the j-th state its last stage may end at,
    using ``u[k]`` devices of kind k; ``costs(k, i)`` are the stage costs on a device of kind k as
    the pipeline's stage i, from each state stage i - 1 may end at (``start``'s, for stage 0)."""
    table: Table = {tuple(0 for _ in counts): (start, np.zeros(len(start), int), np.zeros(len(start), int))}
    for used in sorted(product(*(range(c + 1) for c in counts)), key=sum):
        if sum(used) == 0:
            continue
        value = back = kind = None
        for k, n in enumerate(used):
            if n == 0:
                continue
            prev = table[used[:k] + (n - 1,) + used[k + 1 :]][0]
            options = combine(costs(k, sum(used) - 1), prev[None, :])
            if value is None:
                value = np.full(len(options), np.inf)
                back, kind = np.zeros(len(options), int), np.zeros(len(options), int)
            choice = options.argmin(axis=1)
            candidate = options[np.arange(len(options)), choice]
            better = candidate < value
            value[better], back[better], kind[better] = candidate[better], choice[better], k
        table[used] = (value, back, kind)
    return table


def _backtrack(table: Table, counts: tuple[int, ...], ends: Sequence[np.ndarray]) -> tuple[list[int], list[int]]:
    """The states each stage ends at and the kind of device of each, from the last stage back;
    ``ends``: per stage, the states the program's table for it holds."""
    chain, kinds, used, at = [], [], counts, 0
    while sum(used) > 0:
        chain.append(int(ends[sum(used) - 1][at]))
        _, back, kind = table[used]
        k = int(kind[at])
        kinds.append(k)
        at = int(back[at])
        used = used[:k] + (used[k] - 1,) + used[k + 1 :]
    chain.reverse()
    kinds.reverse()
    return chain, kinds


def stage_nodes_of_chain(space: StateSpace, chain: Sequence[int]) -> list[list[Any]]:
    """The operations of each stage of a chain of states; pinned inputs go to the first stage."""
    sets, before = [], set()
    for j in chain:
        inside = space.down_set(j)
        sets.append([v for v in inside if v not in before])
        before = set(inside)
    return sets


#: the operations, heaviest first, checked for needing more than a device alone
_ALONE_CHECKED = 64


def _needing(needed: int, limit: int, error: InfeasiblePlanError) -> InfeasiblePlanError:
    error.needed_bytes, error.limit_bytes = needed, limit
    return error


def _infeasible(space: StateSpace, specs: Sequence[DeviceSpec], model: CostModel) -> InfeasiblePlanError:
    """Explain why no chain exists: too few states, or which stage exceeds which memory limit."""
    graph = space.graph
    free = [v for v in space.nodes if not graph.nodes[v]["pinned"]]
    limits = [s.memory_bytes for s in specs if s.memory_bytes is not None]
    if not limits:
        return InfeasiblePlanError(f"cannot cut these {len(free)} operations into {len(specs)} stages")
    largest_limit = max(limits)
    heaviest = sorted(free, key=lambda v: -sum(graph.nodes[v][k] for k in (
        "param_bytes", "frozen_bytes", "buffer_bytes", "saved_bytes", "output_bytes")))
    for v in heaviest[:_ALONE_CHECKED]:
        alone = memory_of(graph, [v], model)
        if alone > largest_limit:
            return _needing(alone, largest_limit, InfeasiblePlanError(
                f"operation {v!r} alone needs {alone / 1e9:.3g} GB (parameters, gradients, optimizer "
                f"state and {model.chunks} micro-batches of activations), more than the largest device "
                f"memory limit of {largest_limit / 1e9:.3g} GB; no stage containing it can fit"
            ))
    unlimited = [DeviceSpec(s.name, s.speed, None) for s in specs]
    chain, order = solve_bottleneck(space, unlimited, model)
    built = evaluate_stages(graph, stage_nodes_of_chain(space, chain), order, model)
    worst = max(built, key=lambda st: st.memory_bytes)
    listed = ", ".join(f"{m / 1e9:.3g}" for m in limits)
    placed = [i for i, spec in enumerate(unlimited) if worst.index < len(order) and spec is order[worst.index]]
    limit = specs[placed[0]].memory_bytes if placed else largest_limit
    over = f", {(worst.memory_bytes - limit) / 1e9:.3g} GB over its limit" if limit is not None else ""
    fixes = ["more devices (stages) or more memory per device (memory_gb)", "fewer micro-batches (chunks)"]
    if model.recompute != "always":
        fixes.append("recompute='always' (a stage then keeps only its inputs per micro-batch)")
    fixes.append("a smaller optimizer_multiplier")
    error = InfeasiblePlanError(
        f"no split into {len(specs)} stages fits the memory limits ({listed} GB): the fastest split "
        f"without limits needs {worst.memory_bytes / 1e9:.3g} GB on stage {worst.index}{over} "
        f"({len(worst.nodes)} ops, {worst.nodes[0]} .. {worst.nodes[-1]}: "
        f"{worst.param_bytes / 1e9:.3g} GB parameters, {worst.activation_bytes / 1e9:.3g} GB activations "
        "per micro-batch), and no other split brings every stage under its limit. Give "
        + ", ".join(fixes[:-1]) + f", or {fixes[-1]}."
    )
    error.needed_bytes, error.limit_bytes = worst.memory_bytes, limit
    return error
