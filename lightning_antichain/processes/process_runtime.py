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
``pipeline_parallel_size=``), the batch is still the whole step's: every rank gets it, each replica runs its
``1/dp`` of its samples (one more level of micro-batching), and torch keeps each stage in step
over its replicas (DDP or FSDP2, :mod:`~lightning_antichain.processes.replication`). The step's loss, what it logs and
its predictions are then the whole batch's on every rank, so the layout, chosen by hand or by the
planner, never changes what training computes or what Lightning sees, and a checkpoint resumes in
any layout. (Every rank loads the whole batch; a replica's own share of the data is a step to
come.)
"""


from __future__ import annotations

import dataclasses
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..batches.batch_dims import first_micro_batch
from ..batches.model_loss import counted_items
from ..capture import OpGraph
from ..lightning.forward_patch import ForwardPatch
from ..lightning.runtime import Host, Runtime
from ..planner.layout_cost import gradient_shards
from ..planner.process_calibration import StepCalibration
from ..plans.layout import Layout
from ..plans.options import ProcessOptions, compile_arguments
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule
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
from .rank_layout import ProcessRanks
from .rank_run import RankRun, agree, pipeline_group, replica_share, replicas_group, skipped_message
from .step_logs import unsynced
from .whole_batch_check import WholeBatchCheck

TRAINING = "training_step"

#: the precision plugin's context for each step hook
_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
             "test_step": "test_step_context", "predict_step": "predict_step_context"}


class ProcessRuntime(Runtime):
    """This rank's share of the pipeline and the steps it runs (see the module's docstring): a
    Lightning adapter over the choice of what the ranks run (:mod:`.layout_choice`) and this
    rank's stages running it (:mod:`.rank_run`)."""

    def __init__(self, strategy: Host, options: ProcessOptions) -> None:
        super().__init__(strategy, ProcessRanks(strategy, options), RankHoldings(self))
        self.ranks: ProcessRanks
        self.holdings: RankHoldings
        self.process_options = options
        #: the plan given, or the last run's
        self._plan: Plan | None = None
        #: times the actions of the first training steps, until the plan takes its stage times from them
        self.calibration: StepCalibration | None = StepCalibration() if options.calibrate_steps else None
        self.steps: MicroBatchSteps | None = None
        #: this rank's stages and the steps they run, once built on the first batch
        self._run: RankRun | None = None
        self._forward_patch = ForwardPatch()
        #: reads a failing rank's error while this rank waits on it (:mod:`.rank_faults`)
        self._fault_watch = FaultWatch()
        #: the step kinds whose first step is still to be checked on samples taken together
        self._whole_batch: WholeBatchCheck | None = None
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

    @property
    def layout(self) -> Layout:
        return self.ranks.layout

    def _mesh(self) -> Any:
        mesh = self.ranks.device_mesh
        if mesh is None:
            raise RuntimeError("the device mesh is made in setup_environment")
        return mesh

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
        if self.ranks.search is None or self.plan is not None:  # else once the layout is chosen
            unsynced(module, replicas_group(self.layout, self._mesh()))
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
                None if self.process_options.replication == "fsdp" else pipeline_group(self.layout, self._mesh())))
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
            agree(self.strategy, batch, self.layout if self.ranks.search is None else Layout(
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
                hook, target, batch, rest, self.ranks.schedule, self.layout if self.ranks.search is None else None,
                lambda plan, schedule, layout, mesh, graph: self._pipeline_for(plan, schedule, layout, mesh, target,
                                                                               hook, batch, rest, graph))
            self._plan, graph = chosen.plan, chosen.graph
            if self.ranks.search is not None:
                self.ranks.use(chosen.layout, chosen.schedule, chosen.mesh)
                unsynced(self.steps.module, replicas_group(self.layout, self._mesh()))
            ranks = self.layout.pp
            table = self.ranks.schedule.table(ranks, self._plan.chunks)
            rank_zero_info(f"{self._plan.table()}\nunder {self.ranks.schedule.name} on {ranks} processes "
                           f"({self.ranks.schedule.virtual_stages} stage(s) each): predicted step "
                           f"{1e3 * self._plan.predict_step(table):.1f} ms")
        plan = self._plan
        if plan.measured_together and (plan.calibration or {}).get("schedule") == self.ranks.schedule.name:
            self.calibration = None  # a plan timed under this schedule (a resumed one) is kept as it is
        pipeline, _ = self._pipeline_for(plan, self.ranks.schedule, self.layout, self._mesh(), target, hook, batch,
                                         rest, graph)
        plan = pipeline.plan  # in this layout
        if self._whole_batch is None:
            self._whole_batch = WholeBatchCheck(strategy.options.check_batch)
        self._run = RankRun(strategy, self.steps, pipeline, plan, self.ranks.schedule, self.layout, self._mesh(),
                            self.ranks.search is not None, self.calibration, counted_items(target, *call) is not None,
                            self._whole_batch)
        self.calibration = None  # the run's now, until it has timed its steps
        with_replaced_parameters(strategy.optimizers, pipeline.replaced)
        strategy.stages_placed()  # optimizer state waiting for its parameters to be real and known goes in
        state_sharded_like_parameters(strategy.optimizers)
        self.holdings.hold_own_only()
        return True

    def _choice(self) -> LayoutChoice:
        assert self.steps is not None
        options = self.process_options
        return LayoutChoice(self.strategy, self.steps, self.ranks.search, options.replication, options.layout_trials)

    def _pipeline_for(self, plan: Plan, schedule: ProcessSchedule, layout: Layout, mesh: Any, target: nn.Module,
                      hook: str, batch: Any, rest: tuple, graph: OpGraph | None) -> tuple[ProcessPipeline, OpGraph]:
        """This rank's part of ``plan`` in ``layout`` on ``mesh`` under ``schedule`` (its ``plan``:
        ``plan`` with the replicas' regathering of that layout), and the graph it is cut from
        (``graph`` where it holds for the plan's micro-batches)."""
        assert self.steps is not None
        strategy = self.strategy
        searched = self.ranks.search is not None
        whole = self.steps.call_of(hook, replica_share(batch, layout, strategy.global_rank, searched), rest)
        options = strategy.options
        first = first_micro_batch(target, *whole, plan.chunks, options.batch_dim)
        graph = graph_for_plan(target, first, plan, options.leaf_modules, options.batch_dim, reuse=graph)
        replication = None if layout.dp == 1 else (self.process_options.replication, mesh["dp"])
        regather = plan.regather
        if regather is None:  # a plan given, for this layout: the same choice on every rank
            regather = self._choice().regather(plan, schedule, layout)
        plan = dataclasses.replace(plan, regather=regather, gradient_shards=gradient_shards(
            self.process_options.replication, regather, layout.dp))
        pipeline = ProcessPipeline(graph, plan, schedule, layout.position(strategy.global_rank), layout.pp,
                                   strategy.root_device, group=pipeline_group(layout, mesh),
                                   replication=replication,
                                   initializer=Initializer(target, options.param_init_fn),
                                   recompute=options.recompute == "always",
                                   deferred_batch_norm=options.deferred_batch_norm,
                                   compile_arguments=compile_arguments(options.compile_stages),
                                   regather=plan.regather or "step", timeout=self.strategy.timeout)
        return pipeline, graph
