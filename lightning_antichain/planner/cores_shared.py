"""The layout search's CPU backend: ranks that are CPU processes on one machine share its cores.

On devices of their own (GPUs) the ranks slow each other only by what they send, which the layout's
cost charges (:mod:`.layout_cost`): the search then weighs each layout at its predicted step, and
:class:`Contention` adds nothing. Where the ranks share a machine's cores, they measured how much
(:class:`~.shared_cores.SharedCores`), and :class:`CoresShared` brings that into the search: the
profile's times halfway to the ranks' probe of their step, each profile's parallel capacity and
the optimizer's slowdown as the ranks measured them, and the layout whose step suffers least if
the cores share otherwise than measured (:mod:`.robust_choice`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import networkx as nx

from ..plans.layout import Layout
from ..plans.plan import Plan
from .contention import capacity_of_two
from .cost_graph import total_compute
from .robust_choice import StepOf, least_regret, regrets, steps_as_cores_vary
from .shared_cores import SharedCores, share_of

#: a profile of micro-batches of some size and its cache key, or why it failed
Profiled = tuple[nx.DiGraph, str] | Exception


class Contention:
    """How the ranks slow each other beyond what the layout's cost charges: not at all, each on a
    device of its own. The search asks every question of it; :class:`CoresShared` answers them
    for CPU processes."""

    #: whether the cores' sharing may vary, so that each layout is weighed as it does
    varies = False

    def speed(self, share_profile: Callable[[], Profiled | None]) -> float:
        """The factor every profile's times are scaled by (``share_profile``: the profile of one
        rank's share of the batch, made only where it counts)."""
        return 1.0

    def profiled(self, cost: nx.DiGraph, world_size: int) -> None:
        """What the ranks measured of their sharing, into a new profile's ``cost`` graph."""

    def optimizer_slowdown(self, layout: Layout, replication: str, world_size: int) -> float | None:
        """How much slower the ranks of ``layout`` step the optimizer all at once than one alone
        (``None``: as the model's work slows)."""
        return None

    def spread(self, plan: Plan, step_of: StepOf, layout: Layout, replication: str, world_size: int
               ) -> tuple[float, float] | None:
        """``plan``'s step with the cores shared worse and better than measured (``None``: fixed)."""
        return None

    def best(self, steps: Sequence[tuple[float, float, float]]) -> int:
        """The index of the candidate to take, of their steps ``(predicted, worse, better)``."""
        return min(range(len(steps)), key=lambda i: steps[i][0])

    def regrets(self, steps: Sequence[tuple[float, float, float]]) -> list[float] | None:
        """How far each candidate falls behind the best of the case where it falls furthest
        (``None``: the step does not vary)."""
        return None


class CoresShared(Contention):
    """Ranks that share a machine's cores, as they measured it (``shared``); ``with_a_loss``:
    whether the search charges the loss the last stage computes (the probe then timed it too)."""

    def __init__(self, shared: SharedCores, with_a_loss: bool) -> None:
        self.shared = shared
        self.with_a_loss = with_a_loss
        self.varies = shared.model is not None or shared.optimizer is not None

    def speed(self, share_profile: Callable[[], Profiled | None]) -> float:
        if not self.shared.model_alone_s:
            return 1.0
        return probe_over_profile(self.shared, share_profile(), self.with_a_loss)

    def profiled(self, cost: nx.DiGraph, world_size: int) -> None:
        if self.shared.model is not None:
            cores = cost.graph.get("cpu_cores") or world_size
            cost.graph["parallel_capacity"] = capacity_of_two(self.shared.model, world_size, cores)
        if self.shared.optimizer_tensor_s is not None:
            cost.graph["optimizer_tensor_s"] = self.shared.optimizer_tensor_s

    def optimizer_slowdown(self, layout: Layout, replication: str, world_size: int) -> float | None:
        return optimizer_slowdown(self.shared, layout, replication, world_size)

    def spread(self, plan: Plan, step_of: StepOf, layout: Layout, replication: str, world_size: int
               ) -> tuple[float, float] | None:
        if not self.varies:
            return None
        return steps_as_cores_vary(plan, step_of, self.shared, world_size, share_of(layout, replication))

    def best(self, steps: Sequence[tuple[float, float, float]]) -> int:
        return least_regret(steps) if self.varies else super().best(steps)

    def regrets(self, steps: Sequence[tuple[float, float, float]]) -> list[float] | None:
        return regrets(steps) if self.varies else None


def contention_of(shared: SharedCores | None, with_a_loss: bool) -> Contention:
    """The backend for ranks that measured their sharing of the cores (``shared``), or none."""
    return Contention() if shared is None else CoresShared(shared, with_a_loss)


def probe_over_profile(shared: SharedCores | None, found: Profiled | None, with_a_loss: bool) -> float:
    """The factor that brings the profile's times halfway (geometrically) to the ranks' probe's
    (``found``: the profile of one replica's share of the batch, what the probe ran), where both
    time the same work: 1.0 where either is missing. Both take the quickest of several rounds of
    one rank's step alone, moments apart on a shared machine, and read 0.82-1.19 of each other
    (docs/benchmark-runs.md, "The reduction in the last backward"); every layout of the model then
    came out off alike. Neither lay reliably nearer the training steps that followed (scaled
    wholly to the probe, the rows missed where the profile had been nearer), so the search takes
    both readings of the machine's speed at equal weight."""
    if (shared is None or not shared.model_alone_s or found is None or isinstance(found, Exception)
            or shared.with_loss != with_a_loss):
        return 1.0
    total = total_compute(found[0])
    return math.sqrt(shared.model_alone_s / total) if total > 0 else 1.0


def optimizer_slowdown(shared: SharedCores | None, layout: Layout, replication: str, world_size: int
                       ) -> float | None:
    """How much slower the ranks of ``layout`` step the optimizer all at once than one alone, as
    measured with each stepping its share of the parameters (``None``: not measured)."""
    capacity = None if shared is None else shared.optimizer_at(share_of(layout, replication))
    return None if capacity is None else world_size / capacity
