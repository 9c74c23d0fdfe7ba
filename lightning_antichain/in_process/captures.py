"""Every capture of a Pipeline's module, ready to run: which graph runs a call, and its stages.

A module is captured once per training mode (a graph bakes the mode in), again where the first
graph does not hold for a call (``None`` where it saw a tensor, another constant), and again for a
micro-batch of other shapes than the capture saw. Each capture is cut into stages by the plan, or
by the plan carried over to it where its operations differ (:mod:`.projection`), and its stages
are placed on their devices. The :class:`~.pipeline.Pipeline` asks :class:`Captures` for the
:class:`Runnable` of each call and runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn

from ..batches import microbatch
from ..batches.batch_dims import first_micro_batch, placeholder_batch_dims
from ..capture import NEEDS_EXAMPLE, OpGraph, capture
from ..capture.assignments import Output
from ..capture.devices import on_module_device
from ..capture.isolation import training_flags, training_flags_set
from ..device import StageStreams
from ..plans.plan import Plan
from ..stages.plan_capture import graph_for_plan
from ..stages.split import PlanMismatchError, StageModule, place_stages, split_stages
from ..stages.tied_copies import TiedCopies
from ..weights.initialization import Initializer, ParamInitFn
from ..weights.materialize import has_meta_state, materialize
from .call_layout import CallLayout, Recent
from .projection import project_plan


class Captures:
    """The captures of ``module`` for ``plan`` over ``devices``, by the modules' training flags
    (and, where the graph captured first does not hold for a call, by what that call specialised)."""

    def __init__(self, module: nn.Module, plan: Plan, devices: Sequence[torch.device], chunks: int,
                 batch_dim: Any, leaf_modules: tuple, param_init_fn: ParamInitFn | None = None,
                 slots: Sequence[Hashable] | None = None, compile_arguments: dict[str, Any] | None = None) -> None:
        self.module = module
        #: ``torch.compile``'s arguments for every stage cut (``compile_stages``); ``None``: eager
        self.compile_arguments = compile_arguments
        self.initializer = Initializer(module, param_init_fn)
        self.plan = plan
        self._devices = list(devices)
        self._slots = None if slots is None else list(slots)
        #: the leaves, one per device, of parameters used on several devices, shared by every capture
        self.tied = TiedCopies()
        self._streams: dict[int, StageStreams] = {}
        self.chunks = chunks
        self.batch_dim = batch_dim
        self.leaf_modules = leaf_modules
        self.runnables: dict[Hashable, Runnable] = {}
        self._reference: OpGraph | None = None  # a capture with the plan's own operations
        #: the module and its submodules as the first call found them: walking the tree on every
        #: step for their training flags cost a large model's step a millisecond of host time
        self._modules: list[nn.Module] | None = None

    def given(self, graph: OpGraph) -> Runnable:
        """Make ``graph`` (captured by the caller) the runnable of the mode it was captured in."""
        run = self.runnables[graph.training or training_flags(self.module), None] = self.use(graph, None)
        return run

    def for_call(self, args: tuple, kwargs: dict) -> BoundCall:
        """The capture that runs this call, with the call bound to its placeholders and split into
        micro-batches: the capture made in the modules' present mode (captured now if none was),
        or, where that graph does not hold for the call's first micro-batch (``None`` where it saw
        a tensor, another constant) or for the caches the module holds now
        (:mod:`~lightning_antichain.capture.kept`), one captured for that call from that state."""
        if self._modules is None:
            self._modules = list(self.module.modules())
        mode = tuple(m.training for m in self._modules)
        run = self.runnables.get((mode, None))
        if run is None:
            run = self.runnables[(mode, None)] = self.use(self.capture_for(args, kwargs), (args, kwargs))
        values = run.graph.bind(args, kwargs)
        micro_values = microbatch.scatter(values, self.chunks, run.input_dims)
        specialization, cache = run.graph.specialization, run.graph.cache
        if specialization is not None or cache is not None:
            first = micro_values[0]
            inputs_hold = specialization is None or specialization.holds_for(first)
            if not inputs_hold or (cache is not None and not cache.holds(self.module)):
                key = (mode, None if inputs_hold else specialization.key_of(first),  # type: ignore[union-attr]
                       None if cache is None else cache.key(self.module))
                found = self.runnables.get(key)
                if found is None or (found.graph.cache is not None and not found.graph.cache.holds(self.module)):
                    graph = self._recapture(run.graph, first)
                    found = self.runnables[key] = self.use(graph, (args, kwargs))
                run = found
                values = run.graph.bind(args, kwargs)
                micro_values = microbatch.scatter(values, self.chunks, run.input_dims)
        if run.graph.cache is not None:
            run.graph.cache.apply(self.module)
        return BoundCall(run, values, micro_values)

    def _recapture(self, graph: OpGraph, values: list[Any]) -> OpGraph:
        """``graph``'s frontend again, on these placeholder values, from the module's present state
        (a graph reading a cache comes from export or concrete capture, which specialise)."""
        assert graph.specialization is not None and graph.signature is not None
        return graph.specialization.recapture(*graph.signature.unbind(values))

    def _place(self, stages: list[StageModule], initializer: Initializer | None = None) -> None:
        """Place ``stages``, each on the streams every capture's stage of its index uses: what a
        stage queues there (a tied parameter's gradient) is ordered whichever capture runs."""
        for stage in stages:
            stage.streams = self._streams.setdefault(stage.index, stage.streams)
            stage.compile_arguments = self.compile_arguments
        place_stages(stages, initializer, self._slots, self.tied)

    def use(self, graph: OpGraph, call: tuple[tuple, dict] | None) -> Runnable:
        """Cut the stages out of ``graph`` (by the plan, or by the plan carried over to this graph
        where its operations differ) and place them on their devices."""
        plan, stages = self._split(graph, call)
        self._place(stages, self.initializer)
        if has_meta_state(self.module):  # what no stage uses is made real on the first stage's device
            materialize(self.module.modules(), self._devices[0], "reset", self.initializer)
        placeholders = [n.name for n in graph.nodes if n.kind == "placeholder"]
        names = stages[-1].outputs
        assigned = {leaf.node for a in graph.assignments for leaf in a.leaves if isinstance(leaf, Output)}
        returned = assigned & _returned_names(graph)
        returned_slots = [i for i, n in enumerate(names) if n not in assigned or n in returned]
        return Runnable(
            graph=graph,
            plan=plan,
            stages=stages,
            input_slots=[placeholders.index(name) for name in stages[0].inputs],
            returned_slots=returned_slots,
            assigned_slots={n: i for i, n in enumerate(names) if n in assigned},
            output_names=tuple(names[i] for i in returned_slots),
            input_dims=placeholder_batch_dims(graph, self.batch_dim),
        )

    def _split(self, graph: OpGraph, call: tuple[tuple, dict] | None) -> tuple[Plan, list[StageModule]]:
        """The plan for ``graph`` and the stages cut by it: the Pipeline's plan where ``graph`` has
        its operations, else that plan projected onto ``graph``
        (:func:`~lightning_antichain.in_process.projection.project_plan`)."""
        try:
            stages = split_stages(graph, self.plan, self._devices)
        except PlanMismatchError as mismatch:
            reference = self.reference_graph(call, mismatch)
            if reference is graph:
                raise
            plan = project_plan(self.plan, reference, graph)
            return plan, split_stages(graph, plan, self._devices)
        if self._reference is None:
            self._reference = graph
        return self.plan, stages

    def reference_graph(self, call: tuple[tuple, dict] | None, mismatch: PlanMismatchError) -> OpGraph:
        """A capture whose operations are the plan's: plans are made in training mode, so the module
        is captured in that mode when no capture so far had the plan's operations. Raises
        ``mismatch`` if that one differs too: the plan was made for another model."""
        if self._reference is not None:
            return self._reference
        frontend = self.plan.frontend or "fx"
        if call is None and frontend in NEEDS_EXAMPLE:
            raise mismatch
        with training_flags_set(self.module, True):
            graph = (self.capture_for(*call) if call is not None else
                     capture(self.module, leaf_modules=self.leaf_modules, frontends=(frontend,)))
        try:
            split_stages(graph, self.plan, self._devices)
        except PlanMismatchError:
            raise mismatch from None
        self._reference = graph
        return graph

    def capture_for(self, args: tuple, kwargs: dict) -> OpGraph:
        """Capture the module on the first micro-batch of this call, with the plan's frontend."""
        first = on_module_device(self.module, first_micro_batch(self.module, args, kwargs, self.chunks,
                                                                self.batch_dim))
        return graph_for_plan(self.module, first, self.plan, self.leaf_modules, self.batch_dim)

    def stages_for(self, run: Runnable, values: list[Any]) -> list[StageModule]:
        """The stage modules for one micro-batch: captured again if the graph does not hold for it,
        with the same inputs and outputs as ``run``'s stages, so the micro-batches of a call join."""
        specialization = run.graph.specialization
        if specialization is None or specialization.holds_for(values):
            return run.stages
        key = specialization.key_of(values)
        if key not in run.variants:
            graph = specialization.recapture(*run.graph.signature.unbind(values))
            stages = self._variant_stages(run, graph)
            for new, old in zip(stages, run.stages):
                new.streams = old.streams
            run.variants[key] = stages
        return run.variants[key]

    def _variant_stages(self, run: Runnable, graph: OpGraph) -> list[StageModule]:
        """``graph``'s stages for a micro-batch of another shape than ``run``'s graph holds for. Where
        the two captures name their operations differently, the plan is carried over, and the first
        stage's inputs and the last stage's outputs are matched by position."""
        try:
            return split_stages(graph, run.plan, self._devices)
        except PlanMismatchError as mismatch:
            plan = project_plan(self.plan, self.reference_graph(None, mismatch), graph)
        try:
            plan = _same_interface(plan, graph, run.plan, run.graph)
        except PlanMismatchError as exc:
            raise PlanMismatchError(
                f"{graph.frontend} captured {type(self.module).__name__} again for a micro-batch of other shapes and "
                f"got a different graph: {exc}"
            ) from exc
        stages = split_stages(graph, plan, self._devices)
        self._place(stages)
        return stages



@dataclass
class Runnable:
    """One capture of the module, ready to run: its graph, the plan its stages were cut by (the
    Pipeline's, or that plan carried over to this graph), and how a call's values map onto the stages.

    ``variants`` are the stages of graphs captured again for micro-batches of other shapes, by what
    they specialised; ``grown`` the output shapes of a run with one sample more, by input shapes;
    ``layouts`` how calls are split and joined, by their shapes (:mod:`.call_layout`).
    """

    graph: OpGraph
    plan: Plan
    stages: list[StageModule]
    input_slots: list[int]
    returned_slots: list[int]
    assigned_slots: dict[str, int]
    output_names: tuple[str, ...]
    input_dims: list[Any]
    variants: dict[Hashable, list[StageModule]] = field(default_factory=dict)
    grown: dict[Hashable, Any] = field(default_factory=dict)
    layouts: Recent[Hashable, CallLayout] = field(default_factory=lambda: Recent(8))


class BoundCall(NamedTuple):
    """A call as the capture that runs it takes it: its placeholders' values, and those split into
    micro-batches."""

    run: Runnable
    values: list[Any]
    micro_values: list[list[Any]]


def _same_interface(plan: Plan, graph: OpGraph, like: Plan, like_graph: OpGraph) -> Plan:
    """``plan`` (for ``graph``) with the first stage taking the inputs and the last stage giving the
    outputs that ``like`` does for ``like_graph``, matched by their positions among the graphs'
    placeholders and outputs, so the micro-batches of one call can run on either and be joined."""
    by_position = {}
    for kind in ("placeholder", "output"):
        ours, theirs = _interface_names(graph, kind), _interface_names(like_graph, kind)
        if len(ours) != len(theirs):
            raise PlanMismatchError(f"it has {len(ours)} {kind}s where the first capture had {len(theirs)}")
        by_position.update(zip(theirs, ours))
    inputs = [by_position[name] for name in like.stages[0].inputs]
    outputs = [by_position[name] for name in like.stages[-1].outputs]
    needed_in, given_out = set(plan.stages[0].inputs), set(plan.stages[-1].outputs)
    if not needed_in <= set(inputs) or set(outputs) != given_out:
        raise PlanMismatchError("its inputs or outputs are not those of the first capture")
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], inputs=inputs)
    stages[-1] = dataclasses.replace(stages[-1], outputs=outputs)
    return dataclasses.replace(plan, stages=stages)


def _interface_names(graph: OpGraph, kind: str) -> list[str]:
    """The graph's placeholders in order, or its output values in the order the output node lists them."""
    if kind == "placeholder":
        return [n.name for n in graph.nodes if n.kind == "placeholder"]
    assert graph.graph_module is not None
    found: list[str] = []
    fx.node.map_arg(graph.graph_module.graph.output_node().args[0], lambda n: found.append(n.name))
    return list(dict.fromkeys(found))


def _returned_names(graph: OpGraph) -> set[str]:
    """The output nodes whose values ``forward`` returns (as opposed to only assigning them)."""
    assert graph.graph_module is not None
    signature = graph.signature
    returned = signature.output if signature is not None else graph.graph_module.graph.output_node().args[0]
    found: set[str] = set()
    fx.node.map_arg(returned, lambda n: found.add(n.name))
    return found


