"""``Pipeline``: a module that runs another module as a micro-batched pipeline over several devices.

    plan = la.partition(la.profile(model, example), stages=2, chunks=8)
    pipe = la.Pipeline(model, plan, chunks=8)
    loss = criterion(pipe(x), y)      # forward: all stages busy at once
    loss.backward()                   # backward: pipelined too, gradients land in model's parameters

The wrapped module keeps its parameters, buffers and ``state_dict()``; the Pipeline only decides
where and in what order its operations run.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import Counter
from collections.abc import Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..capture import NEEDS_EXAMPLE, OpGraph, UntraceableModelError, capture, capture_call
from ..capture.assignments import Output, assign
from ..capture.devices import on_module_device
from ..capture.isolation import own_forward, side_effects_undone, training_flags, training_flags_set
from ..capture.pytrees import flatten, iter_tensors, unflatten
from . import microbatch
from .autograd_bridge import PipelineBackward, PipelineFunction
from .batch_dims import (
    check_per_sample,
    first_micro_batch,
    grown_by_one,
    placeholder_batch_dims,
    refuse_per_sample_lists,
)
from .batchnorm import deferred_batch_norm
from .device import shares_host
from .engine import PassState, StepRecord, run_forward
from .options import PipelineOptions
from .output_join import Assigned, MicroOutputs, assigned_dim, output_dims, take_assigned
from .plan import Plan, recomputed_micro_batches
from .projection import project_plan
from .randomness import step_seed
from .saved_tensors import HeldMemory, state_storages
from .schedule import make_schedule
from .split import PlanMismatchError, StageModule, place_stages, split_stages
from .worker import WorkerPool, share_malloc_arena


class Pipeline(nn.Module):
    """Run ``module`` as the stages of ``plan``, ``chunks`` micro-batches at a time (``"auto"``:
    as many as the plan was made for, which :func:`~lightning_antichain.planner.planning.plan_model` with
    ``chunks="auto"`` chooses).

    ``graph`` is the captured graph the plan was made for (see :func:`lightning_antichain.capture`):
    pass the one that was profiled, so the graph that runs is the graph that was planned. Without it,
    the module is captured again with the plan's frontend (on the first call, for frontends that need
    an example). ``recompute`` recomputes activations in backward instead of keeping them:
    ``"never"``, ``"except_last"`` (every micro-batch but the last, whose backward comes first
    anyway) or ``"always"``. ``devices`` overrides the plan's device per stage. Outputs are gathered
    on ``output_device`` (default: the device of the first input tensor, else the first stage's).
    A batch with fewer samples than ``chunks`` runs as that many micro-batches of one sample.
    On the first call it checks that ``forward`` treats each sample on its own
    (:func:`lightning_antichain.runtime.batch_dims.check_per_sample`), as the strategy does before
    profiling; ``check_batch=False`` skips that where the dependence is meant (a mixture of experts
    with a capacity per batch). With stages on several devices and a ``graph`` from torch.export or
    concrete capture, call :func:`lightning_antichain.check_micro_batchable` on the module before
    placing it instead. ``deferred_batch_norm`` updates BatchNorm running statistics once per step
    from the whole batch instead of once per micro-batch (normalisation itself always uses
    micro-batch statistics).
    ``share_cpu_allocator`` lets worker threads share glibc's main malloc arena when a stage runs
    on CPU (see :func:`lightning_antichain.runtime.worker.share_malloc_arena` for why). ``batch_dim`` is
    the dim of the inputs that holds the samples, as DataParallel's ``dim`` (1 for a sequence-first
    ``nn.GRU``), or a dict by ``forward``'s argument names for inputs that differ (others: 0). Each
    output is joined on the dim that follows the micro-batch sizes (``batch_dim`` where several do).
    ``measure_activations`` counts what each stage keeps for backward (saved tensors, and the inputs
    and outputs of its micro-batches, each storage once, parameters left out) into
    :attr:`last_activation_bytes`: an exact count, at the price of a Python call per saved tensor.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        options: PipelineOptions | None = None,
        *,
        devices: Sequence[str | torch.device] | None = None,
        output_device: str | torch.device | None = None,
        graph: OpGraph | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        options = (options or PipelineOptions()).replace(**settings)
        self.options = options
        chunks, recompute, batch_dim = options.chunks, options.recompute, options.batch_dim
        check_batch, leaf_modules = options.check_batch, options.leaf_modules
        deferred_batch_norm, share_cpu_allocator = options.deferred_batch_norm, options.share_cpu_allocator
        measure_activations = options.measure_activations
        chunks = plan.chunks if chunks == "auto" else chunks
        if graph is not None and graph.module is not module:
            raise ValueError("graph= was captured from another module than the one given to Pipeline")
        self.module = module
        self.plan = plan
        self.batch_dim = batch_dim
        self.check_batch = check_batch
        _warn_if_sequence_first(module, self.batch_dim)
        self.chunks = chunks
        self.recompute = recompute
        self.deferred_batch_norm = deferred_batch_norm
        self.output_device = None if output_device is None else torch.device(output_device)
        self.leaf_modules = tuple(leaf_modules)
        self._devices = [torch.device(d) for d in (devices or [s.device for s in plan.stages])]
        if len(self._devices) != plan.num_stages:
            raise ValueError(f"got {len(self._devices)} devices for a plan of {plan.num_stages} stages")
        #: every capture of the module made ready to run, by the modules' training flags (and, where
        #: the graph captured first does not hold for a call, by what that call specialised)
        self._runnables: dict[Hashable, _Runnable] = {}
        self._run: _Runnable | None = None  # the one the last call ran
        self._reference: OpGraph | None = None  # a capture with the plan's own operations
        if share_cpu_allocator and any(shares_host(d) for d in self._devices):
            share_malloc_arena()
        self._pool = WorkerPool(plan.num_stages)
        #: what the stages did in the last training step, forward and backward: each task with when
        #: it ran, to set beside the plan's predicted :meth:`~lightning_antichain.runtime.plan.Plan.timeline`
        self.last_step: StepRecord | None = None
        self.measure_activations = measure_activations
        self._held: list[HeldMemory] | None = None
        weakref.finalize(self, self._pool.shutdown)
        frontend = plan.frontend or "fx"
        if frontend == "children":
            raise UntraceableModelError(
                f"this plan cuts {type(module).__name__} at its top-level children, which is for planning only: "
                "no capture frontend could turn it into a graph the pipeline can run. Keep the block with the "
                "offending code whole with leaf_modules=[...], or pipeline a submodule (module=...). The frontends "
                "said:\n  " + "\n  ".join(plan.refused)
            )
        if graph is None and frontend not in NEEDS_EXAMPLE:  # refuse a plan for another model at once
            graph = capture(module, leaf_modules=self.leaf_modules, frontends=(frontend,))
        if graph is not None:
            self._runnables[(graph.training or training_flags(module), None)] = self._run = self._use(graph, None)

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the Pipeline is garbage collected)."""
        self._pool.shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def graph(self) -> OpGraph | None:
        """The captured graph the last call's stages were cut from (``None`` before the first call,
        unless one was given)."""
        return self._run.graph if self._run is not None else None

    @property
    def stages(self) -> list[Any]:
        """The stages the last call ran (before the first call: those of the graph given, if any)."""
        return list(self._run.stages) if self._run is not None else []

    @property
    def devices(self) -> list[torch.device]:
        return list(self._devices)

    @property
    def tasks_run(self) -> Counter[tuple[int, int]]:
        """Micro-batch tasks (a forward or a backward of one stage) run since the pipeline was made,
        by stage and by the identity of the worker thread that ran them."""
        return Counter(self._pool.tasks_run)

    @property
    def last_activation_bytes(self) -> list[int]:
        """The most bytes each stage kept for backward at once in the last training step (with
        ``measure_activations=True``): what the plan's ``memory_bytes`` predicts beyond parameters,
        gradients, optimizer state and buffers."""
        if self._held is None:
            raise RuntimeError("activations were not measured: create the Pipeline with measure_activations=True "
                               "and run a training step first")
        return [held.peak_bytes for held in self._held]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._forward(args, kwargs)
        except (KeyboardInterrupt, SystemExit):
            self._pool.shutdown()  # wherever the interrupt landed, no worker outlives it
            raise

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        if self.check_batch:
            refuse_per_sample_lists(self.module, args, kwargs, self.batch_dim)
        run = self._runnable_for(args, kwargs)
        values = run.graph.bind(args, kwargs)
        if self.check_batch:
            self._check_per_sample(run, values)
        micro_values = microbatch.scatter(values, self.chunks, run.input_dims)
        micro_batch_stages = [self._stages_for(run, v) for v in micro_values]
        sizes = [microbatch.batch_size(v, run.input_dims) for v in micro_values]
        micro_inputs = [flatten([v[i] for i in run.input_slots]) for v in micro_values]
        output_device = self.output_device or _first_device(args, kwargs) or self._devices[0]
        schedule = make_schedule(self.plan.schedule, len(run.stages), len(micro_inputs))
        draws = any(stage.random_nodes for stages in micro_batch_stages for stage in stages)
        seed = step_seed() if draws else None
        if not torch.is_grad_enabled():
            outputs, assigned = self._take_assigned_of(
                run, run_forward(self._pool, micro_batch_stages, micro_inputs, None, 0, schedule, seed))
            dims = output_dims(outputs, sizes, lambda: self._grown_run(run, micro_values[0])[0])
            leaves = microbatch.gather([leaves for leaves, _ in outputs], output_device, sizes, dims)
            result = self._assemble(run, leaves, outputs[0][1])
            self._assign(run, assigned, micro_values[0], sizes)
            return result
        stop = recomputed_micro_batches(self.recompute, len(micro_inputs))
        if not self.training:
            stop = 0
        per_slot = [flatten(values[i])[0] for i in run.input_slots]
        whole = [leaf for leaves in per_slot for leaf in leaves]
        leaf_dims = [run.input_dims[i] for i, leaves in zip(run.input_slots, per_slot) for _ in leaves]
        grad_inputs = [v for v in whole if _is_grad_tensor(v)]
        held = self._start_measuring(run) if self.measure_activations else None
        state = PassState(StepRecord.for_stages(len(run.stages)), held=held, seed=seed)
        self.last_step = state.record
        with deferred_batch_norm(self.module.modules()) if self.deferred_batch_norm else nullcontext():
            outputs = run_forward(self._pool, micro_batch_stages, micro_inputs, state, stop, schedule)
        outputs, assigned = self._take_assigned_of(run, outputs)
        dims = output_dims(outputs, sizes, lambda: self._grown_run(run, micro_values[0])[0])
        gathered = microbatch.gather([leaves for leaves, _ in outputs], output_device, sizes, dims)
        tensor_at = [i for i, v in enumerate(gathered) if isinstance(v, torch.Tensor)]
        backward = PipelineBackward(
            pool=self._pool,
            state=state,
            count=len(micro_inputs),
            outputs=tuple(gathered[i] for i in tensor_at),
            output_dims=[dims[i] for i in tensor_at],
            output_sizes=[[leaves[i].shape[dims[i]] for leaves, _ in outputs] for i in tensor_at],
            output_is_tensor=[isinstance(v, torch.Tensor) for v in gathered],
            leaf_positions=assigned.leaf_positions,
            leaf_count=assigned.leaf_count,
            grad_input_slots=[i for i, v in enumerate(micro_inputs[0][0]) if _is_grad_tensor(v)],
            input_dims=[d for v, d in zip(whole, leaf_dims) if _is_grad_tensor(v)],
            input_devices=[v.device for v in grad_inputs],
        )
        phony = torch.empty(0, device=output_device, requires_grad=True)
        tensors = iter(PipelineFunction.apply(backward, phony, *grad_inputs))
        result = self._assemble(run, [next(tensors) if isinstance(v, torch.Tensor) else v for v in gathered],
                                outputs[0][1])
        self._assign(run, assigned, micro_values[0], sizes)
        return result

    # -- helpers -------------------------------------------------------------------------------

    def _start_measuring(self, run: _Runnable) -> list[HeldMemory]:
        """Counters for this step, one per stage, that leave the model's own tensors out."""
        if self._held is None:
            excluded = state_storages(self.module)
            for stage in run.stages:
                excluded |= state_storages(stage.module)
            self._held = [HeldMemory(excluded) for _ in run.stages]
        for held in self._held:
            held.reset_peak()
        return self._held

    def prepare(self, *args: Any, training: bool, **kwargs: Any) -> None:
        """Capture and cut the graph for calls like ``args, kwargs`` with the module in training
        (``True``) or eval mode now, rather than at the first such call. The strategy prepares
        the eval graph before Lightning's model summary runs the module with its hooks attached."""
        with training_flags_set(self.module, training):
            self._runnable_for(args, kwargs)

    def _runnable_for(self, args: tuple, kwargs: dict) -> _Runnable:
        """The capture that runs this call: the one made in the modules' present mode (captured now
        if none was), or, where that graph does not hold for the call's first micro-batch (``None``
        where it saw a tensor, another constant), one captured for that call."""
        mode = training_flags(self.module)
        run = self._runnables.get((mode, None))
        if run is None:
            run = self._runnables[(mode, None)] = self._use(self._capture_for(args, kwargs), (args, kwargs))
        specialization = run.graph.specialization
        if specialization is not None:
            first = microbatch.scatter(run.graph.bind(args, kwargs), self.chunks, run.input_dims)[0]
            if not specialization.holds_for(first):
                key = (mode, specialization.key_of(first))
                if key not in self._runnables:
                    graph = specialization.recapture(*run.graph.signature.unbind(first))
                    self._runnables[key] = self._use(graph, (args, kwargs))
                run = self._runnables[key]
        self._run = run
        return run

    def _use(self, graph: OpGraph, call: tuple[tuple, dict] | None) -> _Runnable:
        """Cut the stages out of ``graph`` (by the plan, or by the plan carried over to this graph
        where its operations differ) and place them on their devices."""
        plan, stages = self._split(graph, call)
        place_stages(stages)
        placeholders = [n.name for n in graph.nodes if n.kind == "placeholder"]
        names = stages[-1].outputs
        assigned = {leaf.node for a in graph.assignments for leaf in a.leaves if isinstance(leaf, Output)}
        returned = assigned & _returned_names(graph)
        returned_slots = [i for i, n in enumerate(names) if n not in assigned or n in returned]
        return _Runnable(
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
        (:func:`~lightning_antichain.runtime.projection.project_plan`)."""
        try:
            stages = split_stages(graph, self.plan, self._devices)
        except PlanMismatchError as mismatch:
            reference = self._reference_graph(call, mismatch)
            if reference is graph:
                raise
            plan = project_plan(self.plan, reference, graph)
            return plan, split_stages(graph, plan, self._devices)
        if self._reference is None:
            self._reference = graph
        return self.plan, stages

    def _reference_graph(self, call: tuple[tuple, dict] | None, mismatch: PlanMismatchError) -> OpGraph:
        """A capture whose operations are the plan's: plans are made in training mode, so the module
        is captured in that mode when no capture so far had the plan's operations. Raises
        ``mismatch`` if that one differs too: the plan was made for another model."""
        if self._reference is not None:
            return self._reference
        frontend = self.plan.frontend or "fx"
        if call is None and frontend in NEEDS_EXAMPLE:
            raise mismatch
        with training_flags_set(self.module, True):
            graph = (self._capture_for(*call) if call is not None else
                     capture(self.module, leaf_modules=self.leaf_modules, frontends=(frontend,)))
        try:
            split_stages(graph, self.plan, self._devices)
        except PlanMismatchError:
            raise mismatch from None
        self._reference = graph
        return graph

    def _capture_for(self, args: tuple, kwargs: dict) -> OpGraph:
        """Capture the module on the first micro-batch of this call, with the plan's frontend."""
        first = on_module_device(self.module, first_micro_batch(self.module, args, kwargs, self.chunks,
                                                                self.batch_dim))
        return capture_call(self.module, *first, leaf_modules=self.leaf_modules,
                            frontends=(self.plan.frontend or "fx",), batch_dim=self.batch_dim)

    def _check_per_sample(self, run: _Runnable, values: list[Any]) -> None:
        """Refuse, before the first step, a ``forward`` that micro-batching would change. The stages
        run the check where they call the user's modules (fx), the module itself where the stages
        share one device. An exported graph across devices is left to the caller: its training
        graph bakes in the batch statistics that eval mode keeps out of the check."""
        first = microbatch.scatter(values, self.chunks, run.input_dims)[0]
        signature = run.graph.signature

        def eager(call: list[Any]) -> Any:
            args, kwargs = signature.unbind(call)
            return self.module(*args, **kwargs)

        def staged(call: list[Any]) -> list[Any]:
            outputs, _ = self._run_whole(run, call)
            return outputs[0][0]

        self.check_batch = False
        if run.graph.frontend in ("fx", "leaves"):
            check_per_sample(self.module, first, run.input_dims, staged)
        elif len(set(self._devices)) == 1:
            with own_forward(self.module):
                check_per_sample(self.module, first, run.input_dims, eager)

    def _stages_for(self, run: _Runnable, values: list[Any]) -> list[StageModule]:
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

    def _variant_stages(self, run: _Runnable, graph: OpGraph) -> list[StageModule]:
        """``graph``'s stages for a micro-batch of another shape than ``run``'s graph holds for. Where
        the two captures name their operations differently, the plan is carried over, and the first
        stage's inputs and the last stage's outputs are matched by position."""
        try:
            return split_stages(graph, run.plan, self._devices)
        except PlanMismatchError as mismatch:
            plan = project_plan(self.plan, self._reference_graph(None, mismatch), graph)
        try:
            plan = _same_interface(plan, graph, run.plan, run.graph)
        except PlanMismatchError as exc:
            raise PlanMismatchError(
                f"{graph.frontend} captured {type(self.module).__name__} again for a micro-batch of other shapes and "
                f"got a different graph: {exc}"
            ) from exc
        stages = split_stages(graph, plan, self._devices)
        place_stages(stages)
        return stages


    @staticmethod
    def _take_assigned_of(run: _Runnable, outputs: MicroOutputs) -> tuple[MicroOutputs, Assigned]:
        return take_assigned(outputs, run.returned_slots, run.assigned_slots)

    def _run_whole(self, run: _Runnable, values: list[Any]) -> tuple[list[tuple[list[Any], Any]], Assigned]:
        """One forward of ``values`` through the stages as a single micro-batch, outside any step."""
        leaves = flatten([values[i] for i in run.input_slots])
        return self._take_assigned_of(run, run_forward(self._pool, [self._stages_for(run, values)], [leaves], None, 0))

    def _grown_run(self, run: _Runnable, first: list[Any]
                   ) -> tuple[list[tuple[int, ...] | None], dict[str, tuple[int, ...] | None]]:
        """The shapes of the output leaves and of the assigned values when the first micro-batch has
        one more sample (run once per input shapes, side effects undone)."""
        key = tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in flatten(first)[0])
        if key not in run.grown:
            with side_effects_undone(self.module), torch.no_grad():
                outputs, taken = self._run_whole(run, grown_by_one(first, run.input_dims))

            def shape(value: Any) -> tuple[int, ...] | None:
                return tuple(value.shape) if isinstance(value, torch.Tensor) else None

            run.grown[key] = ([shape(v) for v in outputs[0][0]],
                              {n: shape(v) for n, v in (taken.values[0] if taken.values else {}).items()})
        return run.grown[key]


    def _assign(self, run: _Runnable, assigned: Assigned, first: list[Any], sizes: list[int | None]) -> None:
        """Give the attributes ``forward`` assigns the values a whole-batch call would."""
        if assigned.values:
            assign(self.module, run.graph.assignments, assigned.values, sizes,
                   lambda name, values: assigned_dim(values, sizes, lambda: self._grown_run(run, first)[1].get(name)))

    def _assemble(self, run: _Runnable, leaves: list[Any], spec: Any) -> Any:
        assert run.graph.signature is not None
        by_name = dict(zip(run.output_names, unflatten(leaves, spec)))
        return run.graph.signature.assemble(by_name)


@dataclass
class _Runnable:
    """One capture of the module, ready to run: its graph, the plan its stages were cut by (the
    Pipeline's, or that plan carried over to this graph), and how a call's values map onto the stages.

    ``variants`` are the stages of graphs captured again for micro-batches of other shapes, by what
    they specialised; ``grown`` the output shapes of a run with one sample more, by input shapes.
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


def _warn_if_sequence_first(module: nn.Module, batch_dim: Any) -> None:
    """A sequence-first recurrent layer with the batch split on dim 0 is the likeliest silent mistake."""
    if batch_dim != 0:
        return
    found = [name for name, m in module.named_modules() if isinstance(m, nn.RNNBase) and not m.batch_first]
    if found:
        warnings.warn(
            f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} sequence-first (batch_first=False) and the "
            "pipeline splits dim 0 of the inputs into micro-batches. If the inputs are [time, batch, ...], pass "
            "batch_dim=1; if forward transposes them first, this is fine.",
            stacklevel=3,
        )


def _returned_names(graph: OpGraph) -> set[str]:
    """The output nodes whose values ``forward`` returns (as opposed to only assigning them)."""
    assert graph.graph_module is not None
    signature = graph.signature
    returned = signature.output if signature is not None else graph.graph_module.graph.output_node().args[0]
    found: set[str] = set()
    fx.node.map_arg(returned, lambda n: found.add(n.name))
    return found


def _is_grad_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()


def _first_device(args: tuple, kwargs: dict) -> torch.device | None:
    first = next(iter_tensors((args, kwargs)), None)
    return None if first is None else first.device
