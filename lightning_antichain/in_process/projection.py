"""A plan made for one capture of a model, carried over to another capture of the same model.

A module's graph depends on its train/eval mode (dropout and BatchNorm become other operations,
``if self.training:`` branches come and go) and, for torch.export and concrete capture, on the
micro-batch it was captured on. The plan names the operations of the graph it was made for; another
capture is placed by what its operations touch:

- an operation that uses a parameter or buffer runs on a stage that holds it in the plan (or, where
  its inputs come later, a later stage on the same device), so no tensor ever moves;
- one with the same name and target as a planned operation runs on that operation's stage;
- every other operation as early as its inputs allow.

Every dependency then points forward, so the stages are convex; their cuts are computed for the new
graph. The stages keep the plan's devices and predicted costs, which describe the planned graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from ..capture import OpGraph, OpNode
from ..capture.opgraph import AttrFetch
from ..plans.plan import Plan
from ..stages.split import PlanMismatchError


def project_plan(plan: Plan, planned: OpGraph, graph: OpGraph) -> Plan:
    """``plan``, made for ``planned``, with its stages cut from ``graph`` instead (see the module's doc).

    Raises :class:`PlanMismatchError` where an operation would need a tensor on a device its inputs
    only reach after that device's stages.
    """
    stage_of = plan.stage_of()
    owners: dict[int, set[int]] = {}
    for node in planned.nodes:
        if node.name in stage_of:
            for tensor in _tensors_used(planned, node):
                owners.setdefault(id(tensor), set()).add(stage_of[node.name])
    targets = {node.name: node.target for node in planned.nodes}
    hints = {node.name: stage_of[node.name] for node in graph.nodes
             if node.name in stage_of and targets.get(node.name) == node.target}
    devices = [stage.device for stage in plan.stages]
    assignment: dict[str, int] | None = None
    problem = ""
    for use_hints in (True, False):
        assignment, problem = _assign(graph, owners, hints if use_hints else {}, devices)
        if assignment is not None:
            break
    if assignment is None:
        raise PlanMismatchError(
            f"the plan cannot be carried over to this capture of {type(graph.module).__name__}: {problem}. "
            "Plan again for the mode and shapes the model runs in."
        )
    return dataclasses.replace(plan, stages=_cut_stages(plan, graph, assignment))


def _tensors_used(graph: OpGraph, node: OpNode) -> list[torch.Tensor]:
    """The parameters and buffers an operation fetches, and those of the module it calls."""
    assert graph.graph_module is not None
    found = [AttrFetch(graph.graph_module, name)() for name in node.state]
    if node.kind == "call_module":
        module = graph.graph_module.get_submodule(node.target)
        found += [*module.parameters(), *module.buffers()]
    return [t for t in found if isinstance(t, torch.Tensor)]


def _assign(graph: OpGraph, owners: Mapping[int, set[int]], hints: Mapping[str, int], devices: list[str]
            ) -> tuple[dict[str, int] | None, str]:
    """A stage per operation with every dependency pointing forward, or ``None`` and why not.

    Operations that must share a stage (``graph.together``) are raised to the latest of them and the
    assignment is made again, until it settles (stages only ever grow, so this ends)."""
    floor: dict[str, int] = {}
    used = {node.name: [id(t) for t in _tensors_used(graph, node) if id(t) in owners] for node in graph.nodes}
    for _ in range(len(graph.nodes) + 1):
        stage: dict[str, int] = {}
        for node in graph.nodes:
            lower = max((stage[d] for d in (*node.inputs, *node.after) if d in stage), default=0)
            lower = max(lower, floor.get(node.name, 0))
            held = [owners[key] for key in used[node.name]]
            if held:
                allowed = set.intersection(*held) or set.union(*held)
                candidates = sorted(s for s in allowed if s >= lower)
                if not candidates:
                    on = {devices[s] for s in allowed}
                    candidates = [s for s in range(lower, len(devices)) if devices[s] in on]
                if not candidates:
                    return None, (f"{node.name!r} uses a tensor that stage {min(allowed)} holds on "
                                  f"{devices[min(allowed)]}, but its inputs are computed on stage {lower}")
                hint = hints.get(node.name)
                stage[node.name] = hint if hint in candidates else candidates[0]
            else:
                stage[node.name] = max(lower, hints.get(node.name, lower))
        raised = False
        for group in graph.together:
            top = max(stage[name] for name in group if name in stage)
            for name in group:
                if name in stage and stage[name] < top:
                    floor[name] = top
                    raised = True
        if not raised:
            return stage, ""
    return None, "operations that must share a stage cannot be brought together"


def _cut_stages(plan: Plan, graph: OpGraph, assignment: Mapping[str, int]) -> list:
    """The plan's stages with the operations ``assignment`` gives them and the cuts that follow:
    a stage's inputs are the values made before it and needed at or after it, its outputs those
    made up to it and needed after it (values that skip a stage are relayed through it)."""
    position = {node.name: (-1 if node.kind == "placeholder" else assignment[node.name]) for node in graph.nodes}
    last_use: dict[str, int] = {}
    for node in graph.nodes:
        for source in node.inputs:
            last_use[source] = max(last_use.get(source, -1), assignment[node.name])
    for name in graph.outputs:
        last_use[name] = len(plan.stages)
    stages = []
    for k, stage in enumerate(plan.stages):
        nodes = [n.name for n in graph.nodes if max(position[n.name], 0) == k]
        inputs = [n.name for n in graph.nodes if position[n.name] < k <= last_use.get(n.name, -1)]
        outputs = [n.name for n in graph.nodes if position[n.name] <= k < last_use.get(n.name, -1)]
        stages.append(dataclasses.replace(stage, nodes=nodes, inputs=inputs, outputs=outputs))
    return stages
