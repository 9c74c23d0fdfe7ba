"""``layout_trials=``: the layouts predicted fastest, timed on the ranks before training starts.

Where the cost model predicts two layouts close together, its own error (a few percent on a
machine whose speed moves from minute to minute) decides between them. The ranks therefore build
each of the few layouts predicted fastest on the first batch, run its steps in turns with the
others (so that a machine getting busier or quieter weighs on all alike) and train the one whose
median step was quickest on its slowest rank. Where the quickest has not beaten each other layout
in most of the turns (its lead smaller than the steps' own noise), the turns go on, up to
:data:`MOST_TRIAL_STEPS`. A trial step is a training step: the schedule's
forward and backward through the step's loss, the replicas' reduction and the optimizers' step.
What it changes is put back afterwards (:func:`untouched`), so training computes what it would
have without the trials.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..capture.pytrees import map_tensors
from ..device import synchronize
from ..plans.plan import Plan
from .rank_holdings import everyone
from .step_logs import metrics_kept

#: timed steps of each layout, after one untimed (a pipeline's first step learns its shapes)
TRIAL_STEPS = 5
#: the most timed steps of each layout, while the quickest has not yet won its turns clearly
MOST_TRIAL_STEPS = 15
#: the share of the turns the quickest must have won against each other layout to stop timing
CLEAR_WINS = 0.8


@contextmanager
def untouched(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Generator[None, None, None]:
    """Inside, steps may train ``module`` with ``optimizers``; on leaving, its parameters and their
    gradients, its buffers (BatchNorm's running statistics), its torchmetrics' states and the
    optimizers' states are as they were."""
    params = [p for p in module.parameters() if not p.is_meta]
    values = [p.detach().clone() if p.requires_grad else None for p in params]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    states = [optimizer.state_dict() for optimizer in optimizers]
    states = map_tensors(lambda t: t.clone(), states)
    try:
        with metrics_kept(module):
            yield
    finally:
        with torch.no_grad():
            for p, value, grad in zip(params, values, grads):
                if value is not None:
                    p.copy_(value)
                p.grad = grad
            for b, value in buffers:
                b.copy_(value)
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(state)


@dataclass(frozen=True)
class Turns:
    """Each layout's step, timed in turns: ``seconds[i][r]`` is layout ``i``'s step in turn ``r``
    on the slowest rank."""

    seconds: list[list[float]]

    @functools.cached_property
    def medians(self) -> list[float]:
        return [statistics.median(taken) for taken in self.seconds]

    @functools.cached_property
    def quickest(self) -> int:
        return min(range(len(self.medians)), key=self.medians.__getitem__)

    @property
    def count(self) -> int:
        return len(self.seconds[0])

    def wins(self, other: int) -> int:
        """The turns in which the quickest's step took less time than ``other``'s."""
        return sum(a < b for a, b in zip(self.seconds[self.quickest], self.seconds[other]))

    @property
    def clear(self) -> bool:
        """Whether the quickest beat every other layout in :data:`CLEAR_WINS` of the turns: a lead
        the turns agree on, not one their noise gives (a machine shared or drifting moves single
        steps by more than close layouts differ)."""
        needed = math.ceil(CLEAR_WINS * self.count)
        return all(self.wins(other) >= needed for other in range(len(self.seconds)) if other != self.quickest)


def timed_in_turns(steps: Sequence[Callable[[], None]], device: torch.device, rounds: int = TRIAL_STEPS,
                   most: int = MOST_TRIAL_STEPS) -> Turns:
    """Each of ``steps`` (one per layout, every rank calling them in the same order) timed in
    ``rounds`` turns after one untimed run, and in more, one at a time up to ``most``, until the
    quickest has won clearly (:attr:`Turns.clear`). Every rank decides on the same times."""
    for step in steps:
        step()
    times: list[list[float]] = [[] for _ in steps]
    while True:
        for step, taken in zip(steps, times):
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            step()
            synchronize(device)
            dist.barrier()
            taken.append(time.perf_counter() - start)
        if len(times[0]) < rounds:
            continue
        turns = Turns([[max(column) for column in zip(*layout)] for layout in zip(*everyone(times))])
        if turns.clear or turns.count >= most:
            return turns


def describe(plan: Plan) -> str:
    layout = plan.layout or {}
    return (f"dp={layout.get('dp')} x pp={layout.get('pp')} {layout.get('schedule')} in {plan.chunks} "
            f"micro-batch{'es' if plan.chunks != 1 else ''}")


def trial_report(plans: Sequence[Plan], turns: Turns) -> str:
    """What the ranks timed and what they kept, for the log."""
    kept = turns.quickest

    def timed(i: int, plan: Plan, seconds: float) -> str:
        slower = "" if i == kept else f", slower in {turns.wins(i)} of {turns.count} turns"
        return (f"{describe(plan)}: predicted {1e3 * plan.predicted_step_s:.1f} ms, "
                f"measured {1e3 * seconds:.1f} ms{slower}")

    each = "; ".join(timed(i, plan, seconds) for i, (plan, seconds) in enumerate(zip(plans, turns.medians)))
    whose = "the prediction's choice" if kept == 0 else "not the prediction's choice"
    unsettled = "" if turns.clear else (f" The turns did not settle it (the quickest won fewer than "
                                        f"{CLEAR_WINS:.0%} of them): the layouts are about as fast here.")
    return (f"layout_trials: timed the {len(plans)} layouts predicted fastest, {turns.count} steps each in turns on "
            f"the first batch: {each}. Training {describe(plans[kept])}, {whose}.{unsettled}")


def meta_refusal() -> str:
    return ("layout_trials: the module's parameters are on the meta device (empty_init), made real stage by stage as "
            "the layout places them, so the layouts cannot be built side by side: training the prediction's choice")


def is_on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())

