"""Closing the loop: a split balanced on what its stages take when they run, not only on the profile.

The dynamic program balances the per-operation profile, and a stage in context does not take the
sum of its operations timed one by one: large early activations miss the caches, intra-op threads
and the other stage compete. Calibration (:mod:`.calibration`) measures the real stage times of a
plan and what each operation took inside its stage. Here they are folded back into the costs the
dynamic program sees: each stage's measured time is shared among its operations in proportion to
their in-context times (:func:`in_context`), so the costs of each stage add up to what it
measured, and the program solves again. The new split is measured in turn, for a bounded number
of rounds and seconds, until a split repeats; the best plan measured is kept, not the last one,
and it lists every round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import networkx as nx

from ..plans.plan import Plan

MAX_ROUNDS = 3
"""Rounds after the first measured plan, by default: each costs one calibration of a new split."""

MAX_SECONDS = 120.0
"""No new round starts once the loop has run this long."""


def rebalanced(
    raw: Plan,
    cost: nx.DiGraph,
    cut: Callable[[nx.DiGraph], Plan],
    measure: Callable[[Plan], Plan],
    *,
    rounds: int = MAX_ROUNDS,
    seconds: float = MAX_SECONDS,
    first: Plan | None = None,
) -> Plan:
    """The best measured plan among ``raw`` and the splits cut from costs corrected by measurement.

    ``raw`` was cut from ``cost`` by ``cut``; ``measure(plan)`` returns the plan with its stage times
    measured (a calibrated plan, ``plan.calibration`` set). Each round gives every operation the
    mean of its in-context shares measured so far (:func:`in_context`; without operation times,
    the last plan's stage ratios scale ``cost``: :func:`folded`) and cuts again, also after a round that measured worse
    (one noisy measurement should not end the search; the best is kept). It stops when a split
    repeats, after ``rounds`` rounds, or once ``seconds`` have passed. ``first``: ``raw`` measured
    already. The plan returned has ``rounds``: per split measured, its operations per stage, its
    profiled and measured bottleneck and lower bound, and which was chosen.
    """
    started = time.perf_counter()
    best = measured = first if first is not None else measure(raw)
    history = [_round(raw, measured)]
    tried = {_split(raw)}
    current, current_cost, chosen = raw, cost, 0
    seen: dict[str, list[tuple[float, float]]] = {}
    for _ in range(max(0, rounds)):
        if measured.calibration is None or time.perf_counter() - started > seconds:
            break
        shares = in_context(cost, measured)
        if shares:
            for name, times in shares.items():
                seen.setdefault(name, []).append(times)
            current_cost = with_costs(cost, {name: _mean(times) for name, times in seen.items()})
        else:  # a calibration that did not time its operations (read from an older cache)
            current_cost = folded(current_cost, current, measured)
        current = cut(current_cost)
        if _split(current) in tried:
            break
        tried.add(_split(current))
        measured = measure(current)
        history.append(_round(current, measured))
        if measured.bottleneck_s < best.bottleneck_s:
            best, chosen = measured, len(history) - 1
    for i, row in enumerate(history):
        row["chosen"] = i == chosen
    return replace(best, rounds=history)


def stage_ratios(raw: Plan, measured: Plan) -> list[tuple[float, float]]:
    """Per stage of ``raw``, its measured / profiled forward and backward time (``measured`` is
    ``raw`` calibrated; 1.0 where the profile says zero)."""
    def ratio(measured_s: float, profiled_s: float) -> float:
        return measured_s / profiled_s if profiled_s > 0 else 1.0

    return [(ratio(m.forward_s, p.forward_s), ratio(m.backward_s, p.backward_s))
            for p, m in zip(raw.stages, measured.stages)]


def folded(cost: nx.DiGraph, raw: Plan, measured: Plan) -> nx.DiGraph:
    """``cost`` with each operation of a stage of ``raw`` scaled by that stage's measured / profiled
    forward and backward time (``measured`` is ``raw`` calibrated, ``raw`` was cut from ``cost``),
    so each stage adds up to what it measured. Round after round this is a fixed-point iteration:
    an operation that moves takes its new stage's correction on top of its old one. Operations in
    no stage keep their costs."""
    scaled = cost.copy()
    for stage, (forward, backward) in zip(raw.stages, stage_ratios(raw, measured)):
        for node in stage.nodes:
            if node in scaled:
                attrs = scaled.nodes[node]
                attrs["forward_s"] = attrs.get("forward_s", 0.0) * forward
                attrs["backward_s"] = attrs.get("backward_s", 0.0) * backward
    return scaled


def in_context(cost: nx.DiGraph, measured: Plan) -> dict[str, tuple[float, float]]:
    """Per operation of the calibrated plan ``measured``, its share of its stage's measured forward
    and backward time, in proportion to what it took inside the stage's passes. Empty where the
    calibration did not time them; a stage whose operations' times add up to zero shares its time
    as the profile ``cost`` does instead."""
    timed = (measured.calibration or {}).get("operations") or {}
    if not timed:
        return {}

    def profiled(name: str, key: str) -> float:
        return cost.nodes[name].get(key, 0.0) if name in cost else 0.0

    shares: dict[str, tuple[float, float]] = {}
    for stage in measured.stages:
        forward = _shared(stage.forward_s, {n: timed.get(n, (0.0, 0.0))[0] for n in stage.nodes},
                          {n: profiled(n, "forward_s") for n in stage.nodes})
        backward = _shared(stage.backward_s, {n: timed.get(n, (0.0, 0.0))[1] for n in stage.nodes},
                           {n: profiled(n, "backward_s") for n in stage.nodes})
        shares.update((n, (forward[n], backward[n])) for n in stage.nodes)
    return shares


def with_costs(cost: nx.DiGraph, times: dict[str, tuple[float, float]]) -> nx.DiGraph:
    """``cost`` with the forward and backward seconds of the operations in ``times`` replaced."""
    changed = cost.copy()
    for name, (forward, backward) in times.items():
        if name in changed:
            changed.nodes[name]["forward_s"] = forward
            changed.nodes[name]["backward_s"] = backward
    return changed


def _shared(total: float, weights: dict[str, float], fallback: dict[str, float]) -> dict[str, float]:
    for candidate in (weights, fallback):
        whole = sum(candidate.values())
        if whole > 0:
            return {n: total * w / whole for n, w in candidate.items()}
    return {n: total / len(weights) for n in weights} if weights else {}


def _mean(times: list[tuple[float, float]]) -> tuple[float, float]:
    return sum(t[0] for t in times) / len(times), sum(t[1] for t in times) / len(times)


def _split(plan: Plan) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(s.nodes) for s in plan.stages)


def _round(raw: Plan, measured: Plan) -> dict[str, Any]:
    return {
        "balance": raw.balance,
        "profiled_bottleneck_s": raw.bottleneck_s,
        "profiled_lower_bound_s": raw.lower_bound_s,
        "measured_bottleneck_s": measured.bottleneck_s,
        "measured_lower_bound_s": measured.lower_bound_s,
    }
