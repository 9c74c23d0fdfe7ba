"""Which layout to take when the ranks share a machine's cores: the one whose step suffers least
if the cores share otherwise than the probe measured.

How much work CPU processes get through at once (:mod:`~lightning_antichain.planner.shared_cores`)
moves with the machine: four ranks stepping MobileNetV3 in lockstep got 1.42-1.61 over four
trials a minute apart, a wide MLP 1.24-1.74, and the probe before planning read 1.33-1.81 for
MobileNetV3 from run to run. Layouts lean on it unequally: pure data parallelism runs every rank
at once all step, a pipeline only while its bubbles are filled. Taking the fastest layout at the
probe's one reading then picks, between two layouts predicted within a few percent, the one that
reading favours (MobileNetV3: a pipeline of four, 1.18 of the best measured, where the probe read
low; GPT: four replicas, 1.08 of it, where it read high). So each layout is weighed also with the
cores sharing :data:`CAPACITY_SPREAD` worse and better, and the one whose step falls least behind
the best layout of each case is taken (least regret), the step as measured breaking ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..plans.plan import Plan
from .contention import capacity_of_two
from .shared_cores import SharedCores

#: how far the ranks' sharing of the cores is taken to move from the probe's reading, either way
CAPACITY_SPREAD = 0.12

#: a plan's predicted step in its layout (what :func:`~lightning_antichain.planner.layout_cost.layout_cost` gives)
StepOf = Callable[[Plan], float]


def with_cores_shared(plan: Plan, shared: SharedCores, ranks: int, cores: int, factor: float, share: int = 1
                      ) -> Plan:
    """``plan`` with the ranks getting ``factor`` times the work at once that ``shared`` measured,
    running the model and stepping the optimizer, each rank ``1/share`` of the parameters (no
    more than the cores allow)."""
    most = float(min(ranks, cores))
    changes: dict[str, Any] = {}
    if shared.model is not None:
        changes["parallel_capacity"] = capacity_of_two(min(most, max(1.0, shared.model * factor)), ranks, cores)
    optimizer = shared.optimizer_at(share)
    if optimizer is not None:
        changes["optimizer_slowdown"] = ranks / min(most, max(1.0, optimizer * factor))
    return dataclasses.replace(plan, **changes)


def steps_as_cores_vary(plan: Plan, step_of: StepOf, shared: SharedCores, ranks: int, share: int = 1
                        ) -> tuple[float, float]:
    """The step ``step_of`` predicts for ``plan`` (its ranks each stepping ``1/share`` of the
    parameters) with the cores shared :data:`CAPACITY_SPREAD` worse, and better, than measured."""
    cores = plan.cpu_cores or ranks  # as the search's capacity took it
    return tuple(step_of(with_cores_shared(plan, shared, ranks, cores, 1.0 + sign * CAPACITY_SPREAD, share))
                 for sign in (-1, 1))  # type: ignore[return-value]


def regrets(steps: Sequence[tuple[float, float, float]]) -> list[float]:
    """For candidates' steps ``(as measured, cores sharing worse, better)``, how far each falls
    behind the best candidate of the case where it falls furthest."""
    best = [min(s[case] for s in steps) for case in range(3)]
    return [max(s[case] - best[case] for case in range(3)) for s in steps]


def least_regret(steps: Sequence[tuple[float, float, float]]) -> int:
    """The index of the candidate of least :func:`regrets`; the quickest as measured among equals."""
    regret = regrets(steps)
    return min(range(len(steps)), key=lambda i: (round(regret[i], 12), steps[i][0]))
