"""The strategy's runtime when every stage is a process of its own (``schedule=...``).

Each of the ``ranks`` processes holds one device. On the first batch, rank 0 captures, profiles
and plans as the in-process runtime does, and sends the plan to every rank; each rank captures the
module itself (the plan names its operations, the same in every process) and builds its own stages
only (:class:`~lightning_antichain.processes.process_pipeline.ProcessPipeline`). Every rank gets the
same batches. A step splits the batch into micro-batches; the user's step hook runs once per
micro-batch (:mod:`.micro_batch_steps`); the step's loss is the mean of the micro-batches' losses,
weighted by their samples, and is what every rank returns to Lightning; what the step logs is
merged and logged by every rank (:mod:`.step_logs`).

Where the ranks form ``dp`` replicas of a pipeline of ``pp`` ranks (:class:`~lightning_antichain.plans.layout.Layout`,
``stages=``), the batch is still the whole step's: every rank gets it, each replica runs its
``1/dp`` of its samples (one more level of micro-batching), and torch keeps each stage in step
over its replicas (DDP or FSDP2, :mod:`~lightning_antichain.processes.replication`). The step's loss, what it logs and
its predictions are then the whole batch's on every rank, so the layout, chosen by hand or by the
planner, never changes what training computes or what Lightning sees, and a checkpoint resumes in
any layout. (Every rank loads the whole batch; a replica's own share of the data is a step to
come.)
"""


from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..batches.batch_dims import first_micro_batch
from ..batches.model_loss import counted_items
from ..capture import OpGraph
from ..cpu_allocator import keep_freed_memory
from ..device import shares_host
from ..lightning.forward_patch import ForwardPatch
from ..lightning.runtime import GivenOptions, Host, Runtime
from ..planner.layout_cost import gradient_shards
from ..planner.layout_search import layout_search
from ..planner.planning import AUTO
from ..planner.process_calibration import StepCalibration
from ..plans.layout import Layout
from ..plans.options import PipelineOptions, compile_arguments
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule, process_schedule
from ..stages.plan_capture import graph_for_plan
from ..weights.held_elsewhere import explain_meta_read
from ..weights.initialization import Initializer
from ..weights.optimizer_state import state_sharded_like_parameters, state_with_parameters, with_replaced_parameters
from .global_norm import clip_by_global_norm, clipping_over_ranks
from .layout_choice import LayoutChoice
from .micro_batch_steps import MicroBatchSteps
from .process_pipeline import ProcessPipeline
from .rank_faults import FaultWatch, StageProcessError, explained
from .rank_holdings import RankHoldings
from .rank_run import RankRun, agree, pipeline_group, replica_share, replicas_group, skipped_message
from .replica_batches import replica_loader
from .replication import REPLICATIONS, Replication
from .same_batches import same_order_everywhere
from .step_logs import unsynced
from .whole_batch_check import WholeBatchCheck

TRAINING = "training_step"

#: the precision plugin's context for each step hook
_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
             "test_step": "test_step_context", "predict_step": "predict_step_context"}


class ProcessRuntime(RankHoldings, Runtime):
    """This rank's share of the pipeline and the steps it runs (see the module's docstring): a
    Lightning adapter over the choice of what the ranks run (:mod:`.layout_choice`) and this
    rank's stages running it (:mod:`.rank_run`)."""

    foreign_options = {
        "placement": "places stages on a process's devices; with schedule=, each process holds one device: leave "
                     "it out",
        "log_stage_times": "logs the stage times of the in-process runtime; with schedule=, each rank times its "
                           "actions in its first steps (calibrate=): leave it out",
        "rebalance_rounds": "cuts again on the stage times the in-process runtime measures; with schedule=, the "
                            "plan takes its stage times from the ranks' first steps (calibrate=): leave it out",
    }

    def __init__(self, strategy: Host, schedule: str, virtual_stages: int | None,
                 pipeline_ranks: int | str | None, calibrate: bool, replication: Replication,
                 layout_trials: int | None = None) -> None:
        super().__init__(strategy)
        if replication not in REPLICATIONS:
            raise ValueError(f"replication={replication!r} is not one of {', '.join(map(repr, REPLICATIONS))}")
        #: what the planner chooses of the layout (``pipeline_parallel_size="auto"`` or
        #: ``schedule="auto"``), or ``None``: both given
        self.layout_search = layout_search(pipeline_ranks, schedule, virtual_stages)
        #: the schedule run (a stand-in until planned, where the planner chooses it)
        self.schedule = self.layout_search.schedules[0] if self.layout_search is not None else process_schedule(
            schedule, virtual_stages)
        self._pipeline_ranks = None if pipeline_ranks == AUTO else pipeline_ranks
        #: how each stage is kept in step with its replicas' where there are several
        self.replication = replication
        #: how many of the layouts predicted fastest the ranks time on the first batch (:mod:`.layout_trials`)
        self.layout_trials = layout_trials or 1
        #: the plan given, or the last run's
        self._plan: Plan | None = None
        #: times the actions of the first training steps, until the plan takes its stage times from them
        self.calibration: StepCalibration | None = StepCalibration() if calibrate else None
        self.steps: MicroBatchSteps | None = None
        #: this rank's stages and the steps they run, once built on the first batch
        self._run: RankRun | None = None
        self._forward_patch = ForwardPatch()
        #: reads a failing rank's error while this rank waits on it (:mod:`.rank_faults`)
        self._fault_watch = FaultWatch()
        #: the step kinds whose first step is still to be checked on samples taken together
        self._whole_batch: WholeBatchCheck | None = None
        self._layout: Layout | None = None
        self._device_mesh: Any = None
        #: the user's precision plugin, while the run's clips over every rank (:mod:`.global_norm`)
        self._users_precision: Any = None

    @property
    def plan(self) -> Plan | None:
        return self._run.plan if self._run is not None else self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._plan = plan

    @property
    def pipeline(self) -> ProcessPipeline | None:
        return None if self._run is None else self._run.pipeline

    @classmethod
    def from_arguments(cls, strategy: Host, arguments: Mapping[str, Any]) -> ProcessRuntime:
        return cls(strategy, arguments["schedule"], arguments["virtual_stages"], arguments["pipeline_parallel_size"],
                   arguments["calibrate"], arguments["replication"], arguments["layout_trials"])

    @classmethod
    def refuse_foreign(cls, given: GivenOptions) -> None:
        super().refuse_foreign(given)
        if given.get("recompute") == "except_last":
            raise ValueError("recompute='except_last' is the in-process runtime's; with schedule= use 'always' (every "
                             "stage keeps only its inputs) or 'never'")
        if given.get("layout_trials") not in (None, 1) and AUTO not in (given.get("schedule"),
                                                                       given.get("pipeline_parallel_size")):
            raise ValueError(f"layout_trials={given['layout_trials']!r} times the layouts the planner weighs: give "
                             'pipeline_parallel_size="auto" or schedule="auto" too, or leave it out')
        if (given.get("plan") is not None or given.get("balance") is not None) and (
                AUTO in (given.get("schedule"), given.get("pipeline_parallel_size"))):
            raise ValueError('pipeline_parallel_size="auto" and schedule="auto" plan the layout: leave out plan= and '
                             "balance=, or give pipeline_parallel_size= and schedule= as you planned them")

    def adapt_options(self, options: PipelineOptions) -> PipelineOptions:
        """The plan charges each stage the micro-batches the schedule keeps; the planner does not
        calibrate it (its calibration times the in-process runtime; this runtime times its own
        first steps, :mod:`~lightning_antichain.planner.process_calibration`)."""
        return options.replace(schedule="gpipe" if self.schedule.name == "gpipe" else "1f1b", calibrate=False,
                               even_chunks=True)

    # -- processes and devices -------------------------------------------------------------------

    def devices_per_process(self, requested: int | None, node_devices: int) -> int:
        return 1

    @property
    def shards_data(self) -> bool:
        return False  # every rank gets the whole batch; replicas split it

    @property
    def needs_process_group(self) -> bool:
        return True  # stages as processes talk even alone

    def process_dataloader(self, dataloader: object) -> object:
        """The same order in every process (:mod:`.same_batches`), and, where replicas of a
        pipeline train side by side in a layout given (not planned), each replica's share of every
        batch only (:mod:`.replica_batches`)."""
        dataloader = same_order_everywhere(dataloader)
        if self.layout_search is not None or self.layout.dp == 1:
            return dataloader
        return replica_loader(dataloader, self.layout.dp, self.layout.replica(self.strategy.global_rank))

    def check_devices(self, stages: int | None, what: str) -> None:
        if stages is None:
            return
        ranks, schedule = self.layout.pp, self.schedule
        if stages != schedule.num_stages(ranks):
            raise ValueError(
                f"{what} has {stages} stages but {ranks} processes under schedule={schedule.name!r} hold "
                f"{schedule.num_stages(ranks)} ({schedule.virtual_stages} each); start "
                f"{stages / schedule.virtual_stages:g} processes (devices=), or plan for {ranks}")

    def environment_ready(self) -> None:
        if self.options.share_cpu_allocator and shares_host(self.strategy.root_device):
            keep_freed_memory()  # as stages in one process and planning's profile do
        if self.layout_search is None:
            self.use_layout(self.layout)  # configure_model() may shard or parallelise within a stage

    @property
    def layout(self) -> Layout:
        """How the ranks form pipelines and their replicas (where the planner chooses it, once
        planned on the first batch)."""
        if self._layout is None:
            if self.layout_search is not None:
                raise RuntimeError('pipeline_parallel_size="auto" chooses the layout on the first batch')
            self._layout = Layout.of(self.strategy.world_size, self._pipeline_ranks)
        return self._layout

    def use_layout(self, layout: Layout, mesh: Any = None) -> None:
        """Run ``layout`` on ``mesh``, its mesh made before, or else made now (every rank calls it)."""
        self._layout = layout
        self._device_mesh = layout.mesh(self.strategy.root_device.type, self.strategy.timeout) if mesh is None else mesh
        self.strategy.lightning_module._device_mesh = self._device_mesh

    @property
    def device_mesh(self) -> Any:
        if self._device_mesh is None:
            raise RuntimeError("the device mesh is made in setup_environment")
        return self._device_mesh

    @property
    def default_sharded_checkpoint(self) -> bool:
        return True

    # -- a run ------------------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Make the module's forward answer inside the steps, and clipping by norm take every
        rank's gradients (through a copy of the precision plugin, :mod:`.global_norm`)."""
        strategy = self.strategy
        module = strategy.lightning_module
        if not module.automatic_optimization:
            raise RuntimeError(
                "manual optimization (automatic_optimization = False) runs the backward and the optimizers inside "
                "training_step, but with schedule= the step runs once per micro-batch on the last stage's process "
                "while torch's schedule runs every stage's backward. Use automatic optimization (return the loss), or "
                "leave out schedule= (one process drives the stages, and manual optimization works as in plain "
                "Lightning).")
        if self.steps is None or self.steps.module is not module:
            self.steps = MicroBatchSteps(module, strategy.describe_target())
            if self._run is not None and self._run.pipeline.graph.module is not strategy.target():
                self._let_go()
        if self.layout_search is None or self.plan is not None:  # else once the layout is chosen
            unsynced(module, replicas_group(self.layout, self.device_mesh))
        # every rank logs the whole batch's value already (step_logs): there is nothing to sync
        warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True`")
        plugin = strategy.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            raise ValueError(
                f"precision={plugin.precision!r} scales the loss before Lightning's backward, but with schedule= the "
                "backward runs inside the step, unscaled. Use precision='bf16-mixed' (no loss scaling), or train "
                "without schedule=."
            )
        if self._users_precision is None:
            self._users_precision = plugin
            strategy.precision_plugin = clipping_over_ranks(plugin, lambda params, clip_val: clip_by_global_norm(
                params, clip_val, strategy.root_device,
                set() if self._run is None else self._run.pipeline.tied.counted_elsewhere(),
                # FSDP2's shards: every rank counts its own
                None if self.replication == "fsdp" else pipeline_group(self.layout, self.device_mesh)))
        if trainer.state.fn == TrainerFn.FITTING:
            state_with_parameters(strategy.optimizers)
        self._forward_patch.install(strategy.target(), self.steps.forward)
        self._fault_watch.start()

    def step(self, hook: str, args: tuple, kwargs: dict, plain: Callable[..., Any]) -> Any:
        """Run the step ``hook`` (``training_step``, ...) on the batch ``args[0]`` through the
        pipeline: the step's loss on every rank for training, the batch's predictions for
        prediction, else ``None``. Where another rank failed, its error (:mod:`.rank_faults`)."""
        strategy = self.strategy
        args = (*args, *kwargs.values())
        accumulate = strategy.lightning_module.trainer.accumulate_grad_batches if hook == TRAINING else 1
        with getattr(strategy.precision_plugin, _CONTEXTS[hook])():
            try:
                return self._step(hook, strategy.target(), args, accumulate)
            except Exception as error:
                explain_meta_read(error, strategy.lightning_module)  # before the other ranks are told
                if strategy.global_rank == 0:  # its store outlives its process groups: let go of them (rank_faults)
                    self._let_go()
                    traceback.clear_frames(error.__traceback__)
                cause = explained(error, strategy.global_rank, self._fault_watch)
                if cause is error:
                    raise
                raise cause from None  # the lost connection that told of it says nothing more

    def failed(self, exception: BaseException) -> None:
        """A rank that stops outside a step (a callback raised) leaves its error where the others
        read it, as a failing step does (:func:`~.rank_faults.explained`), and they stop with it."""
        if isinstance(exception, StageProcessError):
            return
        if self.strategy.global_rank == 0:
            self._let_go()  # its store outlives its process groups: let go of them (rank_faults)
        explained(exception, self.strategy.global_rank, self._fault_watch)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, plain: Callable[..., torch.Tensor],
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule ran every micro-batch's backward inside the step: Lightning's hooks run,
        and the step's gradients join the parameters'."""
        strategy = self.strategy
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, strategy.lightning_module)
        if self._run is not None:
            self._run.give_gradients()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, strategy.lightning_module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def teardown(self) -> None:
        self._fault_watch.stop()
        self._forward_patch.uninstall()
        if self._users_precision is not None:
            self.strategy.precision_plugin, self._users_precision = self._users_precision, None

    def _step(self, hook: str, target: nn.Module, args: tuple, accumulate: int) -> Any:
        assert self.steps is not None, "setup() first"
        batch, rest = args[0], tuple(args[1:])
        if self._run is None and not self._build(hook, target, batch, rest):
            agree(self.strategy, batch, self.layout if self.layout_search is None else Layout(
                1, self.strategy.world_size), 0)
            if hook == TRAINING:
                raise RuntimeError(skipped_message(hook, 0, 1))
            return None  # an evaluation step skipped the batch before the module could be planned on it
        assert self._run is not None
        return self._run.step(hook, target, batch, rest, accumulate)

    def _let_go(self) -> None:
        """Drop this rank's stages, keeping their plan (on rank 0, when a rank fails: its store
        outlives its process groups, :mod:`.rank_faults`)."""
        if self._run is not None:
            self._plan, self.calibration, self._run = self._run.plan, self._run.calibration, None

    def _build(self, hook: str, target: nn.Module, batch: Any, rest: tuple) -> bool:
        """Plan on rank 0 (unless a plan was given) and send it to every rank, with the layout where
        the planner chose it (:mod:`.layout_choice`); build this rank's stages. ``batch`` is the
        whole batch. ``False`` where the step skips it (returns ``None`` before calling the
        module): every rank then waits for the next batch, having found the same on the same batch."""
        assert self.steps is not None
        strategy = self.strategy
        call = self.steps.call_of(hook, batch, rest)
        if call is None:
            return False
        graph = None
        if self._plan is None:
            chosen = self._choice().choose(
                hook, target, batch, rest, self.schedule, self.layout if self.layout_search is None else None,
                lambda plan, schedule, layout, mesh, graph: self._pipeline_for(plan, schedule, layout, mesh, target,
                                                                               hook, batch, rest, graph))
            self._plan, graph = chosen.plan, chosen.graph
            if self.layout_search is not None:
                self.schedule = chosen.schedule
                self.use_layout(chosen.layout, chosen.mesh)
                unsynced(self.steps.module, replicas_group(self.layout, self.device_mesh))
            ranks = self.layout.pp
            table = self.schedule.table(ranks, self._plan.chunks)
            rank_zero_info(f"{self._plan.table()}\nunder {self.schedule.name} on {ranks} processes "
                           f"({self.schedule.virtual_stages} stage(s) each): predicted step "
                           f"{1e3 * self._plan.predict_step(table):.1f} ms")
        plan = self._plan
        if plan.measured_together and (plan.calibration or {}).get("schedule") == self.schedule.name:
            self.calibration = None  # a plan timed under this schedule (a resumed one) is kept as it is
        pipeline, _ = self._pipeline_for(plan, self.schedule, self.layout, self.device_mesh, target, hook, batch, rest,
                                         graph)
        if self._whole_batch is None:
            self._whole_batch = WholeBatchCheck(self.options.check_batch)
        self._run = RankRun(strategy, self.steps, pipeline, plan, self.schedule, self.layout, self._device_mesh,
                            self.layout_search is not None, self.calibration, counted_items(target, *call) is not None,
                            self._whole_batch)
        self.calibration = None  # the run's now, until it has timed its steps
        with_replaced_parameters(strategy.optimizers, pipeline.replaced)
        strategy.stages_placed()  # optimizer state waiting for its parameters to be real and known goes in
        state_sharded_like_parameters(strategy.optimizers)
        self._hold_own_only()
        return True

    def _choice(self) -> LayoutChoice:
        assert self.steps is not None
        return LayoutChoice(self.strategy, self.steps, self.layout_search, self.replication, self.layout_trials)

    def _pipeline_for(self, plan: Plan, schedule: ProcessSchedule, layout: Layout, mesh: Any, target: nn.Module,
                      hook: str, batch: Any, rest: tuple, graph: OpGraph | None) -> tuple[ProcessPipeline, OpGraph]:
        """This rank's part of ``plan`` in ``layout`` on ``mesh`` under ``schedule``, and the graph
        it is cut from (``graph`` where it holds for the plan's micro-batches)."""
        assert self.steps is not None
        strategy = self.strategy
        searched = self.layout_search is not None
        whole = self.steps.call_of(hook, replica_share(batch, layout, strategy.global_rank, searched), rest)
        first = first_micro_batch(target, *whole, plan.chunks, self.options.batch_dim)
        graph = graph_for_plan(target, first, plan, self.options.leaf_modules, self.options.batch_dim, reuse=graph)
        replication = None if layout.dp == 1 else (self.replication, mesh["dp"])
        if plan.regather is None:  # a plan given, for this layout: the same choice on every rank
            plan.regather = self._choice().regather(plan, schedule, layout)
        plan.gradient_shards = gradient_shards(self.replication, plan.regather, layout.dp)
        pipeline = ProcessPipeline(graph, plan, schedule, layout.position(strategy.global_rank), layout.pp,
                                   strategy.root_device, group=pipeline_group(layout, mesh),
                                   replication=replication,
                                   initializer=Initializer(target, self.options.param_init_fn),
                                   recompute=self.options.recompute == "always",
                                   deferred_batch_norm=self.options.deferred_batch_norm,
                                   compile_arguments=compile_arguments(self.options.compile_stages),
                                   regather=plan.regather or "step", timeout=self.strategy.timeout)
        return pipeline, graph
