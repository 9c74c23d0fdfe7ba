"""What a layout's step is made of, for a person choosing between layouts: the busiest rank's
compute, each kind of communication (its bytes and its seconds on the links), the optimizer, and
the bubble; the largest of them decides the step.

The seconds are each term alone; the predicted step overlaps some of them (a block's gather
behind the previous block's compute on a GPU), so they need not add up to it. A step whose
communication alone outlasts its compute is communication-bound, whatever the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plans.layout import Layout
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule
from ..processes.replication import Regather, Replication
from .ring_collectives import ring_all_gather_s, ring_all_reduce_s


@dataclass(frozen=True)
class StepTerms:
    """Seconds by term (``compute``, ``sends``, ``all-reduce``, ``all-gather``, ``reduce-scatter``,
    ``optimizer``, ``bubble``), and the bytes a rank sends a step, of the busiest rank."""

    seconds: dict[str, float]
    moved_bytes: int

    @property
    def deciding(self) -> str:
        return max(self.seconds, key=lambda k: self.seconds[k])

    @property
    def communication_bound(self) -> bool:
        moved = sum(v for k, v in self.seconds.items() if k not in ("compute", "optimizer", "bubble"))
        return moved > self.seconds.get("compute", 0.0)


def step_terms(plan: Plan, linked: Plan, schedule: ProcessSchedule, layout: Layout, links: object,
               replication: Replication, regather: Regather, step_s: float, busy_s: tuple[float, ...],
               optimizer_s: float, reduction_s: float) -> StepTerms:
    """The terms of ``plan``'s step in ``layout`` (``linked``: its stages with their transfers over
    the links), as :func:`~.layout_cost.layout_cost` predicted it (``step_s``, each rank's
    ``busy_s``, the longest ``optimizer_s`` and the replicas' ``reduction_s``)."""
    dp, pp, chunks = layout.dp, layout.pp, plan.chunks
    found: list[tuple[dict[str, float], int]] = []
    for position in range(pp):
        indices = schedule.stages_of(position, pp)
        stages = [plan.stages[i] for i in indices]
        seconds = {"compute": chunks * sum(s.forward_s + s.backward_s for s in stages),
                   "sends": chunks * sum(linked.stages[i].transfer_s for i in indices)}
        last = plan.num_stages - 1
        moved = chunks * sum(2 * ((s.input_bytes if s.index > 0 else 0) + (s.output_bytes if s.index < last else 0))
                             for s in stages)
        params = sum(s.param_bytes for s in stages)
        grads = sum(s.param_bytes - s.frozen_bytes for s in stages)
        gbps = links.slowest([layout.rank(d, position) for d in range(dp)]) if dp > 1 else None
        share = (dp - 1) / dp
        if dp > 1 and replication == "fsdp":
            unblocked = sum(s.unblocked_param_bytes if (s.largest_block_bytes or s.unblocked_param_bytes)
                            else s.param_bytes for s in stages)
            times = chunks if regather == "micro_batch" else 1
            gathered = times * (params + (params - unblocked if regather == "micro_batch" else 0))
            scattered = times * grads
            seconds["all-gather"] = ring_all_gather_s(gathered, dp, gbps)
            seconds["reduce-scatter"] = ring_all_gather_s(scattered, dp, gbps)
            moved += int(share * (gathered + scattered))
        elif dp > 1:
            seconds["all-reduce"] = ring_all_reduce_s(grads, dp, gbps)
            moved += int(2 * share * grads)
        found.append((seconds, moved))
    busiest = max(range(pp), key=lambda p: busy_s[p] if p < len(busy_s) else 0.0)
    seconds, moved = found[busiest]
    seconds["optimizer"] = optimizer_s
    seconds["bubble"] = max(0.0, step_s - max(busy_s, default=0.0) - optimizer_s - reduction_s)
    return StepTerms(seconds, moved)
