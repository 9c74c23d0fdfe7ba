"""``Pipeline``: a module that runs another module as a micro-batched pipeline over several devices.

    plan = la.partition(la.profile(model, example), stages=2, chunks=8)
    pipe = la.Pipeline(model, plan, chunks=8)
    loss = criterion(pipe(x), y)      # forward: all stages busy at once
    loss.backward()                   # backward: pipelined too, gradients land in model's parameters

The wrapped module keeps its parameters, buffers and ``state_dict()``; the Pipeline only decides
where and in what order its operations run.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..batches import microbatch
from ..batches.batch_dependence import check_per_sample, refuse_per_sample_lists
from ..batches.batch_dims import grown_by_one, with_samples_of
from ..batches.model_loss import WeightedSum, is_items_in_batch, join_weights, joins_as, with_items_in_batch
from ..batches.output_join import (
    Assigned,
    MicroOutputs,
    assigned_dim,
    flattened_rows,
    output_dims,
    rows_in_sample_order,
    take_assigned,
)
from ..capture import NEEDS_EXAMPLE, OpGraph, UntraceableModelError, capture
from ..capture.assignments import assign
from ..capture.carried import carried
from ..capture.isolation import own_forward, side_effects_undone, training_flags_set
from ..capture.pytrees import flatten, iter_tensors, unflatten
from ..cpu_allocator import keep_freed_memory
from ..device import shares_host
from ..measure.cpu_threads import stage_threads
from ..measure.saved_tensors import HeldMemory, state_storages
from ..plans.options import PipelineOptions, compile_arguments
from ..plans.plan import Plan
from ..plans.schedule import make_schedule, runs_in_process
from ..plans.step_prediction import recomputed_micro_batches
from ..stages.batchnorm import deferred_batch_norm
from ..stages.randomness import step_seed
from ..stages.split import PlanMismatchError, run_eagerly
from ..stages.tied_copies import TiedCopies
from .autograd_bridge import PipelineBackward, PipelineFunction
from .call_layout import CallLayout, call_key
from .captures import Captures, Runnable
from .engine import PassState, StepRecord, run_forward
from .worker import WorkerPool


@dataclass
class SplitBatch:
    """A call of the pipelined module split for its stages: made once per batch by ``_split``,
    read by running and joining."""

    run: Runnable
    layout: CallLayout
    call: tuple[tuple, dict]
    values: list[Any]
    micro_values: list[list[Any]]
    inputs: list[tuple[list[Any], Any]]
    output_device: torch.device
    seed: int | None

    @property
    def sizes(self) -> list[int | None]:
        return self.layout.sizes


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
    (:func:`lightning_antichain.batches.batch_dependence.check_per_sample`), as the strategy does before
    profiling; ``check_batch=False`` skips that where the dependence is meant (a mixture of experts
    with a capacity per batch). With stages on several devices and a ``graph`` from torch.export or
    concrete capture, call :func:`lightning_antichain.check_micro_batchable` on the module before
    placing it instead. ``deferred_batch_norm`` updates BatchNorm running statistics once per step
    from the whole batch instead of once per micro-batch (normalisation itself always uses
    micro-batch statistics).
    ``share_cpu_allocator`` makes glibc's malloc keep freed memory for reuse, in one arena for
    all threads, when a stage runs on CPU (see :func:`lightning_antichain.cpu_allocator.keep_freed_memory`
    for why). ``batch_dim`` is the dim of the inputs that holds the samples, as DataParallel's
    ``dim`` (1 for a sequence-first ``nn.GRU``), or a dict by ``forward``'s argument names for inputs
    that differ (others: 0). Each output is joined on the dim that follows the micro-batch sizes
    (``batch_dim`` where several do).
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
        #: the replicas' per-stage DDP (:class:`~lightning_antichain.in_process.stage_reduction.StageReduction`),
        #: set by whoever runs replicas of this pipeline (before a backward, as late as after its
        #: forward); ``None``: gradients stay this process's
        self.reduction: Any = None
        self.leaf_modules = tuple(leaf_modules)
        self._devices = [torch.device(d) for d in (devices or [s.device for s in plan.stages])]
        if len(self._devices) != plan.num_stages:
            raise ValueError(f"got {len(self._devices)} devices for a plan of {plan.num_stages} stages")
        if options.device_slots is not None and len(options.device_slots) != plan.num_stages:
            raise ValueError(f"got {len(options.device_slots)} device_slots for a plan of {plan.num_stages} stages")
        if not runs_in_process(plan.schedule):
            raise ValueError(f"the plan's schedule {plan.schedule!r} computes the loss per micro-batch, which runs "
                             "with one process per stage; this Pipeline runs the whole batch's loss in one process "
                             "under 'gpipe': run dataclasses.replace(plan, schedule='gpipe'), or plan again without a "
                             "schedule")
        #: every capture of the module made ready to run
        self._captures = Captures(module, plan, self._devices, chunks, batch_dim, self.leaf_modules,
                                  options.param_init_fn, options.device_slots,
                                  compile_arguments(options.compile_stages))
        self._run: Runnable | None = None  # the one the last call ran
        if share_cpu_allocator and any(shares_host(d) for d in self._devices):
            keep_freed_memory()
        self._pool = WorkerPool(plan.num_stages, threads=stage_threads(self._devices, options.cpu_threads))
        #: what the stages did in the last training step, forward and backward: each task with when
        #: it ran, to set beside the plan's predicted :meth:`~lightning_antichain.plans.plan.Plan.timeline`
        self.last_step: StepRecord | None = None
        self.measure_activations = measure_activations
        self._held: list[HeldMemory] | None = None
        weakref.finalize(self, self._pool.shutdown)
        self._run = self._first_capture(graph)

    def _first_capture(self, graph: OpGraph | None) -> Runnable | None:
        """The capture this Pipeline runs before its first call: ``graph`` where given, else the one
        the plan's profile was made from, else the module captured bare (a plan made for another
        model is refused at once); ``None``: the first call captures."""
        module, plan = self.module, self.plan
        frontend = plan.frontend or "fx"
        if frontend == "children":
            raise UntraceableModelError(
                f"this plan cuts {type(module).__name__} at its top-level children, which is for planning only: "
                "no capture frontend could turn it into a graph the pipeline can run. Keep the block with the "
                "offending code whole with leaf_modules=[...], or pipeline a submodule (module=...). The frontends "
                "said:\n  " + "\n  ".join(plan.refused)
            )
        if graph is not None:
            return self._captures.given(graph)
        profiled = carried(plan, module)
        if profiled is not None:  # the capture the plan's profile was made from, of this module as it is
            try:
                return self._captures.given(profiled)
            except PlanMismatchError:
                pass
        if frontend in NEEDS_EXAMPLE:
            return None
        bare = capture(module, leaf_modules=self.leaf_modules, frontends=(frontend,))  # refuse another model's plan
        try:
            return self._captures.given(bare)
        except PlanMismatchError:
            if {n.name for n in bare.nodes} != set(plan.stage_of()):
                raise
            # the plan's operations wired otherwise: its capture took arguments given as
            # constants (None, a flag) as fixed, so the first call captures again with them
            return None

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
    def tied(self) -> TiedCopies:
        """The parameters used on several devices, read there through a leaf per device."""
        return self._captures.tied

    @property
    def tasks_run(self) -> Counter[tuple[int, int]]:
        """Micro-batch tasks (a forward or a backward of one stage) run since the pipeline was made,
        by stage and by the identity of the worker thread that ran them."""
        return Counter(self._pool.tasks_run)

    @property
    def measured_a_step(self) -> bool:
        """Whether :attr:`last_activation_bytes` holds a training step's counts."""
        return self._held is not None

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
        """A batch's path: split it into micro-batches, run them through the stages, join the
        outputs (and, under autograd, one backward that runs the stages' backwards)."""
        self._captures.tied.refresh()  # copies of a parameter used on several devices take its values
        batch = self._split(args, kwargs)
        state = None if not torch.is_grad_enabled() else self._pass_state(batch)
        outputs, assigned = self._run_stages(batch, state)
        return self._join(batch, outputs, assigned, state)

    def _split(self, args: tuple, kwargs: dict) -> SplitBatch:
        """The call bound to the capture that runs it, checked, and cut into micro-batches as its
        shape's layout says: each one's values, stages, samples and flattened inputs."""
        args, kwargs = with_items_in_batch(self.module, args, kwargs)
        if self.check_batch:
            refuse_per_sample_lists(self.module, args, kwargs, self.batch_dim)
        run, values, micro_values = self._captures.for_call(args, kwargs)
        self._run = run
        if self.check_batch:
            self._check_per_sample(run, micro_values[0])
        layout = run.layouts.get(call_key(values, self.chunks), lambda: self._layout(run, micro_values))
        return SplitBatch(
            run=run, layout=layout, call=(args, kwargs), values=values, micro_values=micro_values,
            inputs=[flatten([v[i] for i in run.input_slots]) for v in micro_values],
            output_device=self.output_device or _first_device(args, kwargs) or self._devices[0],
            seed=step_seed() if layout.draws else None,
        )

    def _layout(self, run: Runnable, micro_values: list[list[Any]]) -> CallLayout:
        """How calls of this shape split: made on the first one."""
        micro_stages = [self._captures.stages_for(run, v) for v in micro_values]
        return CallLayout(
            sizes=[microbatch.batch_size(v, run.input_dims) for v in micro_values],
            micro_stages=micro_stages,
            schedule=make_schedule(self.plan.schedule, len(run.stages), len(micro_values)),
            draws=any(stage.random_nodes for stages in micro_stages for stage in stages),
        )

    def _pass_state(self, batch: SplitBatch) -> PassState:
        """What a training (autograd) pass records for its backward: the step's record, activation
        counters, the random seed."""
        held = self._start_measuring(batch.run) if self.measure_activations else None
        pipeline = weakref.ref(self)  # the workers may hold the state: it must not keep the pipeline alive
        state = PassState(StepRecord.for_stages(len(batch.run.stages)), held=held, seed=batch.seed,
                          reduction=lambda: getattr(pipeline(), "reduction", None))
        self.last_step = state.record
        return state

    def _run_stages(self, batch: SplitBatch, state: PassState | None) -> tuple[MicroOutputs, Assigned]:
        """Every micro-batch's forward through the stages, by the schedule; under autograd
        (``state``), keeping what the backward needs (all but the micro-batches recomputed)."""
        if state is None:
            outputs = run_forward(self._pool, batch.layout.micro_stages, batch.inputs, None, 0, batch.layout.schedule,
                                  batch.seed)
            return self._take_assigned_of(batch.run, outputs)
        stop = recomputed_micro_batches(self.recompute, len(batch.inputs)) if self.training else 0
        with deferred_batch_norm(self.module.modules()) if self.deferred_batch_norm else nullcontext():
            outputs = run_forward(self._pool, batch.layout.micro_stages, batch.inputs, state, stop,
                                  batch.layout.schedule)
        return self._take_assigned_of(batch.run, outputs)

    def _join(self, batch: SplitBatch, outputs: MicroOutputs, assigned: Assigned, state: PassState | None) -> Any:
        """The micro-batches' outputs joined into the whole batch's, as the module would return it
        (under autograd, through one function whose backward runs the stages' backwards), and the
        attributes ``forward`` assigns given the whole batch's values."""
        run, sizes, micro_values = batch.run, batch.sizes, batch.micro_values
        micro_leaves = [leaves for leaves, _ in outputs]
        dims = batch.layout.output_dims(micro_leaves, lambda: output_dims(
            outputs, sizes, lambda: self._grown_run(run, micro_values[0])[0],
            lambda: self._rows_in_sample_order(run, micro_values, outputs, sizes),
            lambda i: self._loss_weights(run, batch.call, batch.values, i, sizes)))
        gathered = microbatch.gather(micro_leaves, batch.output_device, sizes, dims)
        if state is not None:
            gathered = self._through_backward(batch, outputs, assigned, state, gathered, dims)
        result = self._assemble(run, gathered, outputs[0][1])
        self._assign(run, assigned, micro_values[0], sizes)
        return result

    def _through_backward(self, batch: SplitBatch, outputs: MicroOutputs, assigned: Assigned, state: PassState,
                          gathered: list[Any], dims: list[Any]) -> list[Any]:
        """``gathered`` as outputs of one autograd function whose backward runs every stage's."""
        run = batch.run
        per_slot = [flatten(batch.values[i])[0] for i in run.input_slots]
        whole = [leaf for leaves in per_slot for leaf in leaves]
        leaf_dims = [run.input_dims[i] for i, leaves in zip(run.input_slots, per_slot) for _ in leaves]
        grad_inputs = [v for v in whole if _is_grad_tensor(v)]
        tensor_at = [i for i, v in enumerate(gathered) if isinstance(v, torch.Tensor)]
        backward = PipelineBackward(
            pool=self._pool,
            state=state,
            count=len(batch.inputs),
            outputs=tuple(gathered[i] for i in tensor_at),
            output_dims=[dims[i] for i in tensor_at],
            output_sizes=[[leaves[i].shape[dims[i]] if isinstance(dims[i], int) else 0 for leaves, _ in outputs]
                          for i in tensor_at],
            output_is_tensor=[isinstance(v, torch.Tensor) for v in gathered],
            leaf_positions=assigned.leaf_positions,
            leaf_count=assigned.leaf_count,
            grad_input_slots=[i for i, v in enumerate(batch.inputs[0][0]) if _is_grad_tensor(v)],
            input_dims=[d for v, d in zip(whole, leaf_dims) if _is_grad_tensor(v)],
            input_devices=[v.device for v in grad_inputs],
        )
        phony = torch.empty(0, device=batch.output_device, requires_grad=True)
        tensors = iter(PipelineFunction.apply(backward, phony, *grad_inputs))
        return [next(tensors) if isinstance(v, torch.Tensor) else v for v in gathered]

    # -- helpers -------------------------------------------------------------------------------

    def _start_measuring(self, run: Runnable) -> list[HeldMemory]:
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
            self._run = self._captures.for_call(args, kwargs).run

    def _check_per_sample(self, run: Runnable, first: list[Any]) -> None:
        """Refuse, before the first step, a ``forward`` that micro-batching would change. The stages
        run the check where they call the user's modules (fx), the module itself where the stages
        share one device. An exported graph across devices is left to the caller: its training
        graph bakes in the batch statistics that eval mode keeps out of the check."""
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

    @staticmethod
    def _take_assigned_of(run: Runnable, outputs: MicroOutputs) -> tuple[MicroOutputs, Assigned]:
        return take_assigned(outputs, run.returned_slots, run.assigned_slots)

    def _run_whole(self, run: Runnable, values: list[Any]) -> tuple[list[tuple[list[Any], Any]], Assigned]:
        """One forward of ``values`` through the stages as a single micro-batch, outside any step."""
        leaves = flatten([values[i] for i in run.input_slots])
        stages = self._captures.stages_for(run, values)
        with run_eagerly(stages):
            return self._take_assigned_of(run, run_forward(self._pool, [stages], [leaves], None, 0))

    def _grown_run(self, run: Runnable, first: list[Any]
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


    def _rows_in_sample_order(self, run: Runnable, micro_values: list[list[Any]], outputs: MicroOutputs,
                              sizes: list[int | None]) -> list[bool | None]:
        """Per output leaf flattened over samples and rows, whether its rows are in sample order
        (:func:`~lightning_antichain.batches.output_join.rows_in_sample_order`): the first
        micro-batch run twice with one more
        sample, another micro-batch's first or last, under one seed (dropout draws alike). Run
        once per input shapes, side effects undone."""
        first = micro_values[0]
        key = ("rows", tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in flatten(first)[0]))
        if key not in run.grown:
            rows = [flattened_rows([leaves[i] for leaves, _ in outputs], sizes)
                    if isinstance(value, torch.Tensor) else None for i, value in enumerate(outputs[0][0])]
            donor, seed = micro_values[-1], 0  # any seed, the same for both runs
            runs = []
            with side_effects_undone(self.module), torch.no_grad():
                for index in (0, -1):
                    grown = with_samples_of(first, donor, run.input_dims, slice(index, index + 1 or None))
                    leaves = flatten([grown[i] for i in run.input_slots])
                    stages = self._captures.stages_for(run, grown)
                    found, _ = self._take_assigned_of(run, run_forward(self._pool, [stages], [leaves], None, 0,
                                                                       seed=seed))
                    runs.append(found[0][0])
            run.grown[key] = rows_in_sample_order(runs[0], runs[1], (sizes[0] or 0) + 1, rows)
        return run.grown[key]

    def _loss_weights(self, run: Runnable, call: tuple[tuple, dict], values: list[Any], leaf: int,
                      sizes: list[int | None]) -> WeightedSum:
        """How output ``leaf``, 0-dim (a loss), joins over the micro-batches: a sum where a Hugging
        Face model divided each micro-batch's loss by the whole batch's count; else the mean over
        samples (or the sum) that the module in eval mode gives on micro-batches 0 and 1 run
        together, checked once per input shapes. Refused where it is neither. ``values`` are the
        call's placeholder values."""
        counted = [i for i, v in enumerate(values) if is_items_in_batch(v, call[1])]
        if counted:
            if "read" not in run.grown:  # whether the graph divides by the count (the model passed it on)
                placeholders = [n for n in run.graph.graph_module.graph.nodes if n.op == "placeholder"]
                run.grown["read"] = bool(placeholders[counted[0]].users)
            if run.grown["read"]:
                return join_weights(sizes, summed=True)
        if len(sizes) == 1:
            return join_weights(sizes, summed=False)
        key = ("loss", leaf, tuple(sizes))
        if key not in run.grown:
            run.grown[key] = self._checked_loss_join(call, leaf, sizes)
        return run.grown[key]

    def _checked_loss_join(self, call: tuple[tuple, dict], leaf: int, sizes: list[int | None]) -> WeightedSum:
        with training_flags_set(self.module, False), side_effects_undone(self.module), torch.no_grad():
            bound = self._captures.for_call(*call)
            evaluated, values = bound.run, bound.micro_values
            together = with_samples_of(values[0], values[1], evaluated.input_dims, slice(None))
            losses = [self._run_whole(evaluated, v)[0][0][0][leaf] for v in (values[0], values[1], together)]
        parts, whole = losses[:2], losses[2]
        for summed in (False, True):
            if joins_as(parts, whole, join_weights(sizes[:2], summed)):
                return join_weights(sizes, summed)
        raise microbatch.MicroBatchError(
            f"the pipelined module returns a 0-dim value (a loss?) that joins over micro-batches neither as a mean "
            f"over samples nor as a sum: {float(parts[0]):.6g} and {float(parts[1]):.6g} on micro-batches of "
            f"{sizes[0]} and {sizes[1]} samples, {float(whole):.6g} on both together (in eval mode). A mean over "
            "tokens with padding is one such: a Hugging Face model called with labels= is joined exactly (its "
            "loss is divided by the whole batch's token count), so pipeline it directly (module='net' for the "
            "strategy); otherwise return per-sample losses (reduction='none') or the logits, and reduce outside "
            "the pipelined module."
        )

    def _assign(self, run: Runnable, assigned: Assigned, first: list[Any], sizes: list[int | None]) -> None:
        """Give the attributes ``forward`` assigns the values a whole-batch call would."""
        if assigned.values:
            assign(self.module, run.graph.assignments, assigned.values, sizes,
                   lambda name, values: assigned_dim(values, sizes, lambda: self._grown_run(run, first)[1].get(name)))

    def _assemble(self, run: Runnable, leaves: list[Any], spec: Any) -> Any:
        assert run.graph.signature is not None
        by_name = dict(zip(run.output_names, unflatten(leaves, spec)))
        return run.graph.signature.assemble(by_name)


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


def _is_grad_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()


def _first_device(args: tuple, kwargs: dict) -> torch.device | None:
    first = next(iter_tensors((args, kwargs)), None)
    return None if first is None else first.device
