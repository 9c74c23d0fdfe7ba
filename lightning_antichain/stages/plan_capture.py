"""The graph a plan's stages are cut from, for one call: the one planning captured where it holds, else a new capture.

Both runtimes cut their stages from a capture of the module on the first micro-batch of a call,
with the frontend the plan was made with. Where planning already captured the module, its graph is
reused if the values it specialised on (a size read, a flag) hold for that micro-batch too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from ..capture import OpGraph, capture_call
from ..plans.plan import Plan


def holds_for_call(graph: OpGraph, call: tuple[tuple, dict]) -> bool:
    """Whether ``graph`` computes the call ``call`` (args, kwargs) as the module does: it holds no
    specialisation, or the values it specialised on are the call's too."""
    specialization = graph.specialization
    return specialization is None or specialization.holds_for(graph.bind(*call))


def graph_for_plan(module: nn.Module, first: tuple[tuple, dict], plan: Plan, leaf_modules: Sequence[type | str],
                   batch_dim: int | Mapping[str, int], reuse: OpGraph | None = None) -> OpGraph:
    """The graph of ``module`` that ``plan``'s stages are cut from, for a call whose first
    micro-batch is ``first``: ``reuse`` where it holds for that micro-batch, else ``module``
    captured on it with the plan's frontend."""
    if reuse is not None and holds_for_call(reuse, first):
        return reuse
    return capture_call(module, *first, leaf_modules=leaf_modules, frontends=(plan.frontend or "fx",),
                        batch_dim=batch_dim)
