"""What the ranks run, chosen on the first batch: the plan, its layout and schedule, and the mesh.

Rank 0 plans (unless a plan was given) and sends the plan to every rank. Where the planner chooses
the layout (``pipeline_parallel_size="auto"`` or ``schedule="auto"``), the ranks first time their
collectives and what they get through at once on CPU processes, so that the layouts are weighed
on this machine's links and cores; with ``layout_trials=``, the layouts predicted fastest are each
built and stepped in turns on every rank (:mod:`.layout_trials`) and the quickest is kept. The
answer is one :class:`Chosen`, which the runtime takes as a whole.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..batches import microbatch
from ..batches.batch_dims import first_micro_batch
from ..capture import OpGraph
from ..capture.isolation import keeps_random_state, planned_in_training
from ..device import is_accelerator
from ..lightning.runtime import Host, rank_zeros_plan
from ..measure.link_speed import CollectiveSpeed, Kind, measured_collectives
from ..planner.layout_cost import Links, measured_links
from ..planner.layout_search import LayoutSearch, chosen_regather, plan_layouts, same_layout, with_verdicts
from ..planner.planning import INTERNODE_GPU_GBPS, Planned, default_bandwidth_gbps
from ..planner.public import planned_for_call, planning_call
from ..planner.shared_cores import SharedCores, share_of, shared_cores
from ..plans.layout import Layout
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule, process_schedule
from .layout_trials import is_on_meta, meta_refusal, timed_in_turns, trial_report, untouched
from .micro_batch_steps import MicroBatchSteps
from .process_pipeline import ProcessPipeline, equal_runs
from .rank_run import replica_share, shape_of, zero_loss
from .replication import Regather, Replication
from .step_logs import StepLogs, metrics_kept
from .step_loss import loss_of, step_loss

TRAINING = "training_step"

#: builds this rank's stages of a plan: ``(plan, schedule, layout, mesh, graph)`` to the pipeline
#: and the graph it is cut from
BuildStages = Callable[[Plan, ProcessSchedule, Layout, Any, "OpGraph | None"], tuple[ProcessPipeline, OpGraph]]


@dataclass(frozen=True)
class Chosen:
    """What the ranks run: the ``plan``, its ``schedule`` and ``layout``, the device ``mesh`` made
    for it (``None``: to be made for the layout), and the ``graph`` the plan was cut from where
    rank 0 captured one (``None``: each rank captures its own)."""

    plan: Plan
    schedule: ProcessSchedule
    layout: Layout
    mesh: Any
    graph: OpGraph | None


class LayoutChoice:
    """Chooses the plan, layout, schedule and mesh on the first batch (see the module's docstring)."""

    def __init__(self, strategy: Host, steps: MicroBatchSteps, search: LayoutSearch | None, replication: Replication,
                 trials: int) -> None:
        self.strategy = strategy
        self.steps = steps
        #: what the planner chooses of the layout, or ``None``: both given
        self.search = search
        self.replication = replication
        #: how many of the layouts predicted fastest are timed (:mod:`.layout_trials`)
        self.trials = trials

    def choose(self, hook: str, target: nn.Module, batch: Any, rest: tuple, schedule: ProcessSchedule,
               layout: Layout | None, build: BuildStages) -> Chosen:
        """Plan on rank 0 and send the plan to every rank; where the planner chooses the layout,
        the one it chose (or the quickest of the trials, each built by ``build``). ``schedule``
        and ``layout``: the ones given (where the planner chooses them, a stand-in schedule and
        ``None``)."""
        strategy = self.strategy
        measured, capacity = None, None  # every rank takes part in timing what the planner weighs layouts on
        if self.search is not None and not is_accelerator(strategy.root_device):
            measured = measured_collectives(strategy.root_device)
            capacity = self._shared_cores(target, hook, batch, rest)
        captured: list[Planned] = []  # what rank 0 planned, with the graph it planned on

        def make() -> Plan:
            planned = self._make_plan(target, hook, batch, rest, schedule, layout, measured, capacity)
            captured.append(planned)
            return planned.plan

        plan = rank_zeros_plan(make, strategy, shared=True)
        graph = captured[0].graph if captured else None
        mesh = None
        others = self._alternatives(captured[0] if captured else None)
        if others:
            plan, graph, mesh = self._timed_choice(hook, target, batch, rest, [plan, *others], graph, build)
        if self.search is not None:
            assert plan.layout is not None, "a layout search's plan names its layout"
            schedule = process_schedule(plan.layout["schedule"], plan.layout["virtual_stages"])
            layout = Layout(plan.layout["dp"], plan.layout["pp"])
        assert layout is not None
        return Chosen(plan, schedule, layout, mesh, graph)

    def links(self, measured: Mapping[Kind, CollectiveSpeed] | None = None) -> Links:
        """The links between ranks the planner charges: ``bandwidth_gbps`` within a node (default
        16 GB/s between GPUs; between CPU processes the process group's own, ``measured``: each
        kind of collective's latency and bandwidth), ``internode_gbps`` across nodes (default the
        same on CPU, 25 GB/s from a GPU: one 200 Gb/s network adapter each)."""
        options = self.strategy.options
        devices = list(self.strategy.parallel_devices or [self.strategy.root_device])
        per_node = len(devices)
        if measured is None:
            within = options.bandwidth_gbps if options.bandwidth_gbps is not None else (
                default_bandwidth_gbps(devices) if any(is_accelerator(d) for d in devices) else None)
            across = options.internode_gbps
            if across is None:
                across = INTERNODE_GPU_GBPS if any(is_accelerator(d) for d in devices) else within
            return Links(per_node, within, across)
        return measured_links(per_node, measured, options.bandwidth_gbps, options.internode_gbps)

    def stage_devices(self, layout: Layout, schedule: ProcessSchedule) -> list[torch.device]:
        """Where each stage of the first pipeline of ``layout`` under ``schedule`` runs: its rank's device."""
        devices = self.strategy.parallel_devices
        assert devices
        return [devices[layout.rank(0, schedule.rank_of(s, layout.pp)) % len(devices)]
                for s in range(schedule.num_stages(layout.pp))]

    def regather(self, plan: Plan, schedule: ProcessSchedule, layout: Layout,
                 measured: Mapping[Kind, CollectiveSpeed] | None = None) -> Regather | None:
        """How FSDP2 gathers in ``layout``: the fastest way that fits (see ``chosen_regather``)."""
        return chosen_regather(plan, schedule, layout, self.links(measured), self.replication,
                               self.stage_devices(layout, schedule), self.strategy.options.memory_gb)

    def _make_plan(self, target: nn.Module, hook: str, batch: Any, rest: tuple, schedule: ProcessSchedule,
                   layout: Layout | None, measured: Mapping[Kind, CollectiveSpeed] | None,
                   capacity: SharedCores | None) -> Planned:
        """The plan for the layout given, or for the one the planner chooses on the whole ``batch``
        (weighed on the ``measured`` collectives and the ranks' ``capacity``). In a layout given,
        each replica loads its own share, so ``batch`` is this replica's."""
        strategy, options = self.strategy, self.strategy.options
        loss = self._step_loss(hook, batch, rest)
        if self.search is not None:  # the module as the step calls it: once per micro-batch, as it is
            args, kwargs = self.steps.call_of(hook, batch, rest)  # type: ignore[misc]
            with torch.enable_grad(), metrics_kept(self.steps.module):
                return plan_layouts(target, args, kwargs, strategy.world_size, self.stage_devices, self.search,
                                    self.links(measured), options, optimizers=strategy.optimizers,
                                    replication=self.replication, shared_cores=capacity, loss=loss,
                                    alternatives=self.trials - 1)
        assert layout is not None
        whole = self.steps.call_of(hook, batch, rest)
        devices = self.stage_devices(layout, schedule)
        with torch.enable_grad(), metrics_kept(self.steps.module):
            args, kwargs = planning_call(target, *whole, options, count_items=False)
            planned = planned_for_call(target, args, kwargs, devices, options, strategy.optimizers, loss)
        return dataclasses.replace(planned, plan=dataclasses.replace(
            planned.plan, regather=self.regather(planned.plan, schedule, layout, measured)))

    def _alternatives(self, planned: Planned | None) -> list[Plan]:
        """The plans of the layouts to time against rank 0's choice (:mod:`.layout_trials`), on every rank."""
        if self.search is None or self.trials < 2:
            return []
        if self.strategy.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return []  # trials time training steps; validating, testing or predicting alone trains nothing
        sent = None if planned is None else [plan.to_dict() for plan in planned.alternatives]
        return [Plan.from_dict(data) for data in self.strategy.broadcast(sent)]

    @keeps_random_state
    def _timed_choice(self, hook: str, target: nn.Module, batch: Any, rest: tuple, plans: list[Plan],
                      graph: OpGraph | None, build: BuildStages) -> tuple[Plan, OpGraph | None, Any]:
        """Of ``plans`` (the prediction's choice first), the one whose layout trained the first
        batch fastest on the ranks, with the graph it is cut from and the mesh made for it: each
        built on every rank and stepped in turns (:mod:`.layout_trials`), leaving the module as it was."""
        if is_on_meta(target):
            rank_zero_info(meta_refusal())
            return plans[0], graph, None
        strategy, module = self.strategy, self.steps.module
        built: list[tuple[Layout, Any, Any]] = []
        graphs: list[OpGraph] = []

        def step(index: int) -> Callable[[], None]:
            def run() -> None:
                layout, mesh, pipeline = built[index]
                module._device_mesh = mesh  # what the step's code sees as the module's mesh
                self._trial_step(pipeline, plans[index], layout, hook, batch, rest)
            return run

        with untouched(module, strategy.optimizers):
            for plan in plans:
                assert plan.layout is not None
                schedule = process_schedule(plan.layout["schedule"], plan.layout["virtual_stages"])
                layout = Layout(plan.layout["dp"], plan.layout["pp"])
                mesh = layout.mesh(strategy.root_device.type, strategy.timeout)
                module._device_mesh = mesh
                pipeline, found = build(plan, schedule, layout, mesh, graph)
                built.append((layout, mesh, pipeline))
                graphs.append(found)
            del pipeline  # else the last layout built outlives the collection below, holding the parameters
            turns = timed_in_turns([step(i) for i in range(len(plans))], strategy.root_device)
        kept = turns.quickest
        mesh = built[kept][1]
        built.clear()
        gc.collect()  # the other layouts' DDP wrappers let go of the parameters' hooks
        rows = plans[0].layouts
        for plan, seconds in zip(plans, turns.medians):
            for row in rows:
                if same_layout(row, plan):
                    row["measured_step_s"] = seconds
        with_verdicts(rows, next(row for row in rows if same_layout(row, plans[kept])))
        chosen = dataclasses.replace(plans[kept], layouts=rows)
        rank_zero_info(trial_report(plans, turns))
        return chosen, graphs[kept], mesh

    def _trial_step(self, pipeline: ProcessPipeline, plan: Plan, layout: Layout, hook: str, batch: Any,
                    rest: tuple) -> None:
        """A training step of ``batch`` through ``pipeline`` (built for ``plan`` in ``layout``) and
        the optimizers' step, its logs dropped."""
        steps, device = self.steps, self.strategy.root_device
        share = replica_share(batch, layout, self.strategy.global_rank, self.search is not None)
        micro = microbatch.scatter(share, plan.chunks, lists=True)
        calls = [steps.call_of(hook, m, rest) for m in micro] if pipeline.holds_first else None
        logs = StepLogs()

        def loss(output: Any, m: int) -> torch.Tensor:
            if hook != TRAINING:  # the sanity check's validation batch came first: a training step without its loss
                return zero_loss(output, device)
            result = steps.result_of(hook, micro[m], rest, output, logs, 1.0)
            return zero_loss(output, device) if result is None else loss_of(result, hook) / len(micro)

        with torch.enable_grad():
            for run in equal_runs([microbatch.batch_size(m) or 0 for m in micro]):
                pipeline.run(shape_of(micro[run.start:run.stop]), None if calls is None else calls[run.start:run.stop],
                             lambda output, m, start=run.start: loss(output, start + m), len(run), True)
            pipeline.tied.sum_gradients()
        for optimizer in self.strategy.optimizers:
            optimizer.step()
        for p in pipeline.parameters():
            p.grad = None

    @keeps_random_state
    def _shared_cores(self, target: nn.Module, hook: str, batch: Any, rest: tuple) -> SharedCores | None:
        """What the ranks get through at once (:func:`shared_cores`), each on its share of the ``batch``."""
        args, kwargs = self.steps.call_of(hook, batch, rest)  # type: ignore[misc]
        world = self.strategy.world_size
        share = first_micro_batch(target, args, kwargs, world, self.strategy.options.batch_dim)
        assert self.search is not None
        counts = self.search.pipeline_counts(world)
        shares = [share_of(Layout(world // pp, pp), self.replication) for pp in counts]
        with planned_in_training(target), metrics_kept(self.steps.module):
            return shared_cores(target, *share, self.strategy.optimizers, shares=shares,
                                loss=self._step_loss(hook, batch, rest))

    def _step_loss(self, hook: str, batch: Any, rest: tuple) -> Callable[[Any], torch.Tensor | None] | None:
        """What the last stage's rank computes beyond the model, for the planner to charge
        (:mod:`.step_loss`): the training step's loss; ``None`` for other steps (a sanity check's
        validation batch planning first), whose loss trains nothing."""
        return step_loss(self.steps, hook, batch, rest) if hook == TRAINING else None
