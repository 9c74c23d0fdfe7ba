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

import gc
import traceback
import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..batches import microbatch
from ..batches.batch_dependence import BatchDependenceError
from ..batches.batch_dims import first_micro_batch
from ..batches.model_loss import counted_items
from ..capture import OpGraph
from ..capture.isolation import keeps_random_state, planned_in_training
from ..capture.pytrees import flatten, map_tensors
from ..cpu_allocator import keep_freed_memory
from ..device import is_accelerator, shares_host
from ..lightning.forward_patch import ForwardPatch
from ..lightning.runtime import GivenOptions, Host, Runtime, rank_zeros_plan
from ..measure.link_speed import CollectiveSpeed, Kind, measured_collectives
from ..planner.layout_cost import Links, gradient_shards, measured_links
from ..planner.layout_search import chosen_regather, layout_search, plan_layouts, same_layout, with_verdicts
from ..planner.planning import AUTO, INTERNODE_GPU_GBPS, Planned, default_bandwidth_gbps
from ..planner.process_calibration import StepCalibration, from_records
from ..planner.public import planned_for_call, planning_call
from ..planner.shared_cores import SharedCores, share_of, shared_cores
from ..plans.layout import Layout
from ..plans.options import PipelineOptions, compile_arguments
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule, process_schedule
from ..stages.plan_capture import graph_for_plan
from ..weights.held_elsewhere import explain_meta_read
from ..weights.initialization import Initializer
from ..weights.optimizer_state import state_sharded_like_parameters, state_with_parameters, with_replaced_parameters
from .global_norm import clip_by_global_norm
from .layout_trials import is_on_meta, meta_refusal, timed_in_turns, trial_report, untouched
from .micro_batch_steps import MicroBatchSteps, refuse_whole_batch_arguments
from .process_pipeline import ProcessPipeline, equal_runs
from .rank_faults import FaultWatch, StageProcessError, explained
from .rank_holdings import RankHoldings, everyone
from .replica_batches import replica_loader
from .replication import REPLICATIONS, Regather, Replication
from .same_batches import StepAgreement, agree_on_step, same_order_everywhere
from .small_broadcast import broadcast_object
from .step_logs import (
    StepLogs,
    StepValues,
    averaged_logs,
    metric_states,
    metrics_kept,
    replay,
    set_metric_states,
    set_step_values,
    unsynced,
)
from .step_loss import loss_of, step_loss
from .whole_batch_check import WholeBatchCheck

TRAINING = "training_step"
PREDICTING = "predict_step"


#: the precision plugin's context for each step hook
_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
             "test_step": "test_step_context", "predict_step": "predict_step_context"}


class ProcessRuntime(RankHoldings, Runtime):
    """This rank's share of the pipeline and the steps it runs (see the module's docstring)."""

    foreign_options = {
        "placement": "places stages on a process's devices; with schedule=, each process holds one device: leave "
                     "it out",
        "log_stage_times": "logs the stage times of the in-process runtime; with schedule=, each rank times its "
                           "actions in its first steps (calibrate=): leave it out",
        "rebalance_rounds": "cuts again on the stage times the in-process runtime measures; with schedule=, the "
                            "plan takes its stage times from the ranks' first steps (calibrate=): leave it out",
    }

    plan: Plan | None = None  # type: ignore[assignment]  # Runtime's properties, plain attributes here
    pipeline: ProcessPipeline | None = None  # type: ignore[assignment]

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
        self.plan = None
        #: times the actions of the first training steps, until the plan takes its stage times from them
        self.calibration: StepCalibration | None = StepCalibration() if calibrate else None
        self.pipeline = None
        self.steps: MicroBatchSteps | None = None
        self._forward_patch = ForwardPatch()
        #: reads a failing rank's error while this rank waits on it (:mod:`.rank_faults`)
        self._fault_watch = FaultWatch()
        self._stashed: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        #: each metric's value for the whole batch of a step (what Lightning logs on_step)
        self._step_values = StepValues()
        #: whether the module computes a loss over label tokens (a Hugging Face model given labels=)
        self._counts_items = False
        #: the step kinds whose first step is still to be checked on samples taken together
        self._whole_batch: WholeBatchCheck | None = None
        self._layout: Layout | None = None
        self._device_mesh: Any = None

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

    def stage_devices_of(self, layout: Layout, schedule: ProcessSchedule) -> list[torch.device]:
        """Where each stage of the first pipeline of ``layout`` under ``schedule`` runs: its rank's device."""
        devices = self.strategy.parallel_devices
        assert devices
        return [devices[layout.rank(0, schedule.rank_of(s, layout.pp)) % len(devices)]
                for s in range(schedule.num_stages(layout.pp))]

    @property
    def default_sharded_checkpoint(self) -> bool:
        return True

    # -- a run ------------------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Make the module's forward answer inside the steps, and clipping by norm take every
        rank's gradients."""
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
            self.pipeline = None if self.pipeline is None or self.pipeline.graph.module is not strategy.target() else (
                self.pipeline)
        if self.layout_search is None or self.plan is not None:  # else once the layout is chosen
            unsynced(module, self._replicas_group())
        # every rank logs the whole batch's value already (step_logs): there is nothing to sync
        warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True`")
        plugin = strategy.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            raise ValueError(
                f"precision={plugin.precision!r} scales the loss before Lightning's backward, but with schedule= the "
                "backward runs inside the step, unscaled. Use precision='bf16-mixed' (no loss scaling), or train "
                "without schedule=."
            )
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_by_global_norm(  # type: ignore[method-assign]
            plugin.main_params(optimizer), clip_val, strategy.root_device, self.counted_elsewhere(),
            None if self.replication == "fsdp" else self._pipeline_group())  # shards: every rank counts its own
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
                    self.pipeline = None
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
            self.pipeline = None  # its store outlives its process groups: let go of them (rank_faults)
        explained(exception, self.strategy.global_rank, self._fault_watch)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, plain: Callable[..., torch.Tensor],
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule ran every micro-batch's backward inside the step: Lightning's hooks run,
        and the step's gradients join the parameters'."""
        strategy = self.strategy
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, strategy.lightning_module)
        self.give_gradients()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, strategy.lightning_module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def teardown(self) -> None:
        self._fault_watch.stop()
        self._forward_patch.uninstall()
        vars(self.strategy.precision_plugin).pop("clip_grad_by_norm", None)

    def _step(self, hook: str, target: nn.Module, args: tuple, accumulate: int) -> Any:
        assert self.steps is not None, "setup() first"
        batch, rest = args[0], tuple(args[1:])
        if self.pipeline is None and not self._build(hook, target, batch, rest):
            self._agree(batch, 0)
            if hook == TRAINING:
                raise RuntimeError(_skipped(hook, 0, 1))
            return None  # an evaluation step skipped the batch before the module could be planned on it
        share = self._replica_share(batch)
        pipeline, plan = self.pipeline, self.plan
        assert pipeline is not None and plan is not None
        micro = microbatch.scatter(share, plan.chunks, lists=True)
        sizes = [microbatch.batch_size(m) or 0 for m in micro]
        calls = [self.steps.call_of(hook, m, rest) for m in micro] if pipeline.holds_first else None
        for call, samples in zip(calls or (), sizes):
            if call is not None:
                refuse_whole_batch_arguments(target, self.steps.describe, hook, call, samples, self.options.batch_dim)
        counted = [c for c in calls or () if c is not None] if self._counts_items else []
        agreement = self._agree(share, sum(sizes), None if calls is None else sum(c is not None for c in calls) / len(
            calls), float(sum(counted_items(target, *c) for c in counted)) if counted else None)
        if agreement.called is not None and agreement.called < 1:
            if agreement.called == 0 and hook != TRAINING:
                return None  # an evaluation step that returned None before calling the module: skipped
            called = sum(c is not None for c in calls) if calls is not None else 0
            raise RuntimeError(_skipped(hook, called, len(micro)))
        return self._run(hook, share, micro, sizes, calls, rest, accumulate, agreement)

    def _agree(self, batch: Any, samples: int, called: float | None = None, items: float | None = None
               ) -> StepAgreement:
        """:func:`~.same_batches.agree_on_step` for this rank's replica."""
        layout = self.layout if self.layout_search is None or self.plan is not None else Layout(
            1, self.strategy.world_size)
        strategy = self.strategy
        return agree_on_step(batch, strategy.root_device, layout.dp, layout.replica(strategy.global_rank), samples,
                             called, items)

    def _run(self, hook: str, batch: Any, micro: list[Any], sizes: list[int], calls: list[Any] | None, rest: tuple,
             accumulate: int, agreement: StepAgreement) -> Any:
        """Run the micro-batches ``micro`` of ``sizes`` samples (this replica's ``batch``) through
        the pipeline, the step ``hook`` answering each one's output on the last stage's rank; what
        every rank returns to Lightning (see :meth:`step`). ``agreement``: what every rank knows of
        the step."""
        assert self.steps is not None and self.pipeline is not None and self.plan is not None
        module, pipeline = self.steps.module, self.pipeline
        shares = self._shares(sizes, agreement)
        logs = StepLogs()
        if self._whole_batch is None:
            self._whole_batch = WholeBatchCheck(self.options.check_batch)
        seen = self._whole_batch.watch(hook) if pipeline.holds_last else None
        losses: list[torch.Tensor] = []  # weighted as the schedule back-propagates them, read once after
        train = hook == TRAINING
        results: list[Any] = [None] * len(micro)
        skipped: list[bool] = [False] * len(micro)

        def loss(output: Any, m: int) -> torch.Tensor:
            assert self.steps is not None
            share = shares(output, m)
            result = self.steps.result_of(hook, micro[m], rest, output, logs, share)
            if seen is not None:
                seen.keep(m, output, share)
            if train and result is None:  # skipped after the module's call: no gradient from it
                skipped[m] = True
                return _zero_loss(output, self.strategy.root_device)
            if not train:
                results[m] = map_tensors(lambda t: t.detach().cpu(), result)
                return torch.zeros((), device=self.strategy.root_device)
            value = loss_of(result, hook)
            weighted = value * share(value)
            losses.append(weighted.detach())
            if isinstance(result, dict) and len(result) > 1:  # what else it returns goes to the batch-end hooks
                results[m] = map_tensors(lambda t: t.detach().cpu(), {k: v for k, v in result.items() if k != "loss"})
            return weighted / accumulate

        every = [len(equal_runs(microbatch.split_sizes(n, self.plan.chunks))) for n in agreement.samples]
        runs = equal_runs(sizes, max(every))  # as many as every replica's: each run's last backward reduces
        calibration = self.calibration if train and len(runs) == 1 and len(micro) == self.plan.chunks else None
        with torch.enable_grad() if train else torch.no_grad(), \
                self._gradients_stashed(pipeline.parameters()) if train else nullcontext(), \
                self._step_values.watching(module) if pipeline.holds_last else nullcontext(), \
                calibration.timing(self.strategy.root_device) if calibration is not None else nullcontext() as clock:
            for run in runs:
                pipeline.run(_shape_of(micro[run.start:run.stop]), None if calls is None else calls[run.start:run.stop],
                             lambda output, m, start=run.start: loss(output, start + m), len(run), train, clock=clock)
            if train:
                pipeline.tied.sum_gradients()
        if calibration is not None and calibration.done:
            self._calibrated(calibration)
        mean = float(torch.stack(losses).sum()) if losses else 0.0
        problem = None if seen is None else WholeBatchCheck.problem(seen, self.steps, hook, batch, micro, rest, sizes)
        sent = (mean, logs.merged(), metric_states(module), self._step_values.values(), results, skipped, problem
                ) if pipeline.holds_last else None
        mean, merged, states, values, results, skipped, problem = broadcast_object(
            sent, pipeline.last_rank(), self._pipeline_group(), self.strategy.root_device)
        if any(skipped):
            self._stashed = []
            raise RuntimeError(_skipped(hook, len(skipped) - sum(skipped), len(skipped)))
        if not pipeline.holds_last:
            set_metric_states(module, states)
        set_step_values(module, values)
        if self.layout.dp > 1:  # the whole batch's, from every replica's share
            mean, merged, results, sizes, problem = self._over_replicas(mean, merged, results, sizes, agreement,
                                                                        problem)
        if problem is not None:
            self._stashed = []
            raise BatchDependenceError(problem)
        replay(module, merged, sum(agreement.samples), self.strategy.root_device)
        joined = None if all(r is None for r in results) else microbatch.join_results(results, sizes)
        joined = map_tensors(lambda t: t.to(self.strategy.root_device), joined)
        if not train:
            return joined
        loss_value = torch.tensor(mean, device=self.strategy.root_device)
        return loss_value if joined is None else {"loss": loss_value, **joined}

    def _shares(self, sizes: list[int], agreement: StepAgreement) -> Callable[[Any, int], Callable[[Any], float]]:
        """For a micro-batch's output and index, the share of the whole batch that a value its step
        computes has, where the values of the micro-batches join as their weighted sum: its share
        of the step's samples, or, for the loss a Hugging Face model computes from ``labels=`` (a
        mean over the label tokens that count), its share of those tokens, as the in-process
        runtime joins it (:mod:`~lightning_antichain.batches.model_loss`). Replicas' shares count
        ``dp`` times: their gradients are averaged over the replicas."""
        assert self.steps is not None
        steps, target, dp = self.steps, self.strategy.target(), len(agreement.samples)
        samples, items = sum(agreement.samples), None if agreement.items is None else sum(agreement.items)

        def of(output: Any, m: int) -> Callable[[Any], float]:
            model_loss = _model_loss(output) if items is not None else None

            def share(value: Any) -> float:
                if model_loss is not None and value is model_loss and steps.given_call is not None:
                    return dp * float(counted_items(target, *steps.given_call)) / max(float(items), 1.0)
                return dp * sizes[m] / samples

            return share

        return of

    def links(self, measured: Mapping[Kind, CollectiveSpeed] | None = None) -> Links:
        """The links between ranks the planner charges: ``bandwidth_gbps`` within a node (default
        16 GB/s between GPUs; between CPU processes the process group's own, ``measured``: each
        kind of collective's latency and bandwidth), ``internode_gbps`` across nodes (default the
        same on CPU, 25 GB/s from a GPU: one 200 Gb/s network adapter each)."""
        devices = list(self.strategy.parallel_devices or [self.strategy.root_device])
        per_node = len(devices)
        if measured is None:
            within = self.options.bandwidth_gbps if self.options.bandwidth_gbps is not None else (
                default_bandwidth_gbps(devices) if any(is_accelerator(d) for d in devices) else None)
            across = self.options.internode_gbps
            if across is None:
                across = INTERNODE_GPU_GBPS if any(is_accelerator(d) for d in devices) else within
            return Links(per_node, within, across)
        return measured_links(per_node, measured, self.options.bandwidth_gbps, self.options.internode_gbps)

    def _replica_share(self, batch: Any) -> Any:
        """This rank's replica's part of the whole ``batch`` (all of it where there is one replica,
        or where each replica loads only its share: a layout given, not planned)."""
        layout = self.layout
        if layout.dp == 1 or self.layout_search is None:
            return batch
        shares = microbatch.scatter(batch, layout.dp, lists=True)
        sizes = [microbatch.batch_size(share) or 0 for share in shares]
        if len(shares) != layout.dp or len(set(sizes)) > 1:
            raise ValueError(
                f"a batch of {sum(sizes)} samples splits over the {layout.dp} pipeline replicas into shares of {sizes} "
                f"samples; every replica needs an equal share. Make the batch size a multiple of {layout.dp} x chunks, "
                "and set drop_last=True in the DataLoader where the last batch is shorter.")
        return shares[layout.replica(self.strategy.global_rank)]

    def _over_replicas(self, mean: float, merged: list, results: list, sizes: list[int], agreement: StepAgreement,
                       problem: str | None) -> tuple[float, list, list, list[int], str | None]:
        """The step's loss, logs and predictions over every replica's share: the loss the mean of
        theirs (each weighted by its share already), the logs reduced over the shares, the
        predictions in the batch's order, with every micro-batch's samples; and the first replica's
        problem with its step's values, if any (:mod:`.whole_batch_check`)."""
        shares = everyone((mean, merged, results, sizes, problem), self._replicas_group())
        mean = sum(share[0] for share in shares) / len(shares)
        merged = averaged_logs([share[1] for share in shares], list(agreement.samples))
        problem = next((share[4] for share in shares if share[4] is not None), None)
        return (mean, merged, [r for share in shares for r in share[2]], [n for share in shares for n in share[3]],
                problem)

    def _calibrated(self, calibration: StepCalibration) -> None:
        """Take the plan's stage times from every rank's timed actions (every rank calls it at the
        same step), and say how the prediction moved."""
        assert self.plan is not None and self.pipeline is not None
        layout = self.layout
        table = self.schedule.table(layout.pp, self.plan.chunks)
        records = everyone(calibration.record())
        first = [records[rank] for rank in layout.pipeline(0)]  # every replica takes the first one's plan
        self.plan = self.pipeline.plan = from_records(self.plan, table, first)
        self.calibration = None
        found = self.plan.calibration or {}
        optimizer = self.plan.optimizer_step_s  # predicted, not in the steps timed
        rank_zero_info(f"{self.schedule.name} on {layout.pp} processes, timed over {found.get('steps')} "
                       f"steps: the schedule's tasks predicted {1e3 * (self.plan.predicted_step_s - optimizer):.1f} "
                       f"ms (from the profile: {1e3 * (found.get('profiled_step_s', 0.0) - optimizer):.1f} ms), "
                       f"measured {1e3 * found.get('measured_step_s', 0.0):.1f} ms; with the optimizer's step, "
                       f"predicted {1e3 * self.plan.predicted_step_s:.1f} ms")

    @contextmanager
    def _gradients_stashed(self, params: list[torch.nn.Parameter]) -> Generator[None, None, None]:
        """The step's gradients wait aside until :meth:`give_gradients`: Lightning clears the
        gradients between the training step and the backward, and the schedule ran both."""
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
            self._stashed = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for p, grad in zip(params, before):
                p.grad = grad

    def counted_elsewhere(self) -> set[int]:
        """The ids of this rank's tied copies whose gradient another rank counts in a norm."""
        return set() if self.pipeline is None else self.pipeline.tied.counted_elsewhere()

    def give_gradients(self) -> None:
        """Add the last training step's gradients to the parameters' (Lightning's backward)."""
        stashed, self._stashed = self._stashed, []
        for p, grad in stashed:
            p.grad = grad if p.grad is None else p.grad + grad

    def _pipeline_group(self) -> Any:
        """The process group of this rank's pipeline (``None``, the world, where there is one pipeline)."""
        return None if self.layout.dp == 1 else self.device_mesh["pp"].get_group()

    def _replicas_group(self) -> Any:
        """The process group of this rank's stages' replicas (``None`` where there are none)."""
        return None if self.layout.dp == 1 else self.device_mesh["dp"].get_group()

    def _build(self, hook: str, target: nn.Module, batch: Any, rest: tuple) -> bool:
        """Plan on rank 0 (unless a plan was given) and send it to every rank, with the layout where
        the planner chose it; build this rank's stages. ``batch`` is the whole batch. ``False``
        where the step skips it (returns ``None`` before calling the module): every rank then
        waits for the next batch, having found the same on the same batch."""
        assert self.steps is not None
        strategy = self.strategy
        call = self.steps.call_of(hook, batch, rest)
        if call is None:
            return False
        self._counts_items = counted_items(target, *call) is not None
        graph = None
        if self.plan is None:
            measured, capacity = None, None  # every rank takes part in timing what the planner weighs layouts on
            if self.layout_search is not None and not is_accelerator(strategy.root_device):
                measured = measured_collectives(strategy.root_device)
                capacity = self._shared_cores(target, hook, batch, rest)
            captured: list[Planned] = []  # what rank 0 planned, with the graph it planned on

            def make() -> Plan:
                planned = self._make_plan(target, hook, batch, rest, measured, capacity)
                captured.append(planned)
                return planned.plan

            self.plan = rank_zeros_plan(make, strategy, shared=True)
            graph = captured[0].graph if captured else None
            others = self._alternatives(captured[0] if captured else None)
            if others:
                self.plan, graph = self._timed_choice(hook, target, batch, rest, [self.plan, *others], graph)
            chosen = self.plan.layout
            if chosen is not None and self.layout_search is not None:
                if not others:  # else the trials left the kept layout's mesh in place
                    self.schedule = process_schedule(chosen["schedule"], chosen["virtual_stages"])
                    self.use_layout(Layout(chosen["dp"], chosen["pp"]))
                unsynced(self.steps.module, self._replicas_group())
            ranks = self.layout.pp
            table = self.schedule.table(ranks, self.plan.chunks)
            rank_zero_info(f"{self.plan.table()}\nunder {self.schedule.name} on {ranks} processes "
                           f"({self.schedule.virtual_stages} stage(s) each): predicted step "
                           f"{1e3 * self.plan.predict_step(table):.1f} ms")
        plan = self.plan
        if plan.measured_together and (plan.calibration or {}).get("schedule") == self.schedule.name:
            self.calibration = None  # a plan timed under this schedule (a resumed one) is kept as it is
        self.pipeline, _ = self._pipeline_for(plan, target, hook, batch, rest, graph)
        with_replaced_parameters(strategy.optimizers, self.pipeline.replaced)
        strategy.stages_placed()  # optimizer state waiting for its parameters to be real and known goes in
        state_sharded_like_parameters(strategy.optimizers)
        self._hold_own_only()
        return True

    def _pipeline_for(self, plan: Plan, target: nn.Module, hook: str, batch: Any, rest: tuple,
                      graph: OpGraph | None) -> tuple[ProcessPipeline, OpGraph]:
        """This rank's part of ``plan`` in the layout and schedule set now, and the graph it is cut
        from (``graph`` where it holds for the plan's micro-batches)."""
        assert self.steps is not None
        strategy = self.strategy
        whole = self.steps.call_of(hook, self._replica_share(batch), rest)
        first = first_micro_batch(target, *whole, plan.chunks, self.options.batch_dim)
        graph = graph_for_plan(target, first, plan, self.options.leaf_modules, self.options.batch_dim, reuse=graph)
        layout = self.layout
        replication = None if layout.dp == 1 else (self.replication, self.device_mesh["dp"])
        if plan.regather is None:  # a plan given, for this layout: the same choice on every rank
            plan.regather = self._regather(plan, None)
        plan.gradient_shards = gradient_shards(self.replication, plan.regather, layout.dp)
        pipeline = ProcessPipeline(graph, plan, self.schedule, layout.position(strategy.global_rank), layout.pp,
                                   strategy.root_device, group=self._pipeline_group(), replication=replication,
                                   initializer=Initializer(target, self.options.param_init_fn),
                                   recompute=self.options.recompute == "always",
                                   deferred_batch_norm=self.options.deferred_batch_norm,
                                   compile_arguments=compile_arguments(self.options.compile_stages),
                                   regather=plan.regather or "step", timeout=self.strategy.timeout)
        return pipeline, graph

    def _alternatives(self, planned: Planned | None) -> list[Plan]:
        """The plans of the layouts to time against rank 0's choice (:mod:`.layout_trials`), on every rank."""
        if self.layout_search is None or self.layout_trials < 2:
            return []
        if self.strategy.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return []  # trials time training steps; validating, testing or predicting alone trains nothing
        sent = None if planned is None else [plan.to_dict() for plan in planned.alternatives]
        return [Plan.from_dict(data) for data in self.strategy.broadcast(sent)]

    @keeps_random_state
    def _timed_choice(self, hook: str, target: nn.Module, batch: Any, rest: tuple, plans: list[Plan],
                      graph: OpGraph | None) -> tuple[Plan, OpGraph | None]:
        """Of ``plans`` (the prediction's choice first), the one whose layout trained the first
        batch fastest on the ranks, with the graph it is cut from: each built on every rank and
        stepped in turns (:mod:`.layout_trials`), leaving the module as it was."""
        assert self.steps is not None
        if is_on_meta(target):
            rank_zero_info(meta_refusal())
            return plans[0], graph
        strategy, module = self.strategy, self.steps.module
        built: list[tuple[ProcessSchedule, Layout, Any, ProcessPipeline]] = []
        graphs: list[OpGraph] = []

        def enter(schedule: ProcessSchedule, layout: Layout, mesh: Any) -> None:
            self.schedule = schedule
            self.use_layout(layout, mesh)

        def step(index: int) -> Callable[[], None]:
            def run() -> None:
                schedule, layout, mesh, pipeline = built[index]
                enter(schedule, layout, mesh)
                self._trial_step(pipeline, plans[index], hook, target, batch, rest)
            return run

        with untouched(module, strategy.optimizers):
            for plan in plans:
                assert plan.layout is not None
                self.schedule = process_schedule(plan.layout["schedule"], plan.layout["virtual_stages"])
                self.use_layout(Layout(plan.layout["dp"], plan.layout["pp"]))
                pipeline, found = self._pipeline_for(plan, target, hook, batch, rest, graph)
                built.append((self.schedule, self.layout, self._device_mesh, pipeline))
                graphs.append(found)
            del pipeline  # else the last layout built outlives the collection below, holding the parameters
            turns = timed_in_turns([step(i) for i in range(len(plans))], strategy.root_device)
        kept = turns.quickest
        enter(*built[kept][:3])
        built.clear()
        gc.collect()  # the other layouts' DDP wrappers let go of the parameters' hooks
        rows = plans[0].layouts
        for plan, seconds in zip(plans, turns.medians):
            for row in rows:
                if same_layout(row, plan):
                    row["measured_step_s"] = seconds
        with_verdicts(rows, next(row for row in rows if same_layout(row, plans[kept])))
        chosen = plans[kept]
        chosen.layouts = rows
        rank_zero_info(trial_report(plans, turns))
        return chosen, graphs[kept]

    def _trial_step(self, pipeline: ProcessPipeline, plan: Plan, hook: str, target: nn.Module, batch: Any,
                    rest: tuple) -> None:
        """A training step of ``batch`` through ``pipeline`` and the optimizers' step, its logs dropped."""
        assert self.steps is not None
        steps, device = self.steps, self.strategy.root_device
        micro = microbatch.scatter(self._replica_share(batch), plan.chunks, lists=True)
        calls = [steps.call_of(hook, m, rest) for m in micro] if pipeline.holds_first else None
        logs = StepLogs()

        def loss(output: Any, m: int) -> torch.Tensor:
            if hook != TRAINING:  # the sanity check's validation batch came first: a training step without its loss
                return _zero_loss(output, device)
            result = steps.result_of(hook, micro[m], rest, output, logs, 1.0)
            return _zero_loss(output, device) if result is None else loss_of(result, hook) / len(micro)

        with torch.enable_grad():
            for run in equal_runs([microbatch.batch_size(m) or 0 for m in micro]):
                pipeline.run(_shape_of(micro[run.start:run.stop]), None if calls is None else calls[run.start:run.stop],
                             lambda output, m, start=run.start: loss(output, start + m), len(run), True)
            pipeline.tied.sum_gradients()
        for optimizer in self.strategy.optimizers:
            optimizer.step()
        for p in pipeline.parameters():
            p.grad = None

    @keeps_random_state
    def _shared_cores(self, target: nn.Module, hook: str, batch: Any, rest: tuple) -> SharedCores | None:
        """What the ranks get through at once (:func:`shared_cores`), each on its share of the ``batch``."""
        assert self.steps is not None
        args, kwargs = self.steps.call_of(hook, batch, rest)  # type: ignore[misc]
        world = self.strategy.world_size
        share = first_micro_batch(target, args, kwargs, world, self.options.batch_dim)
        assert self.layout_search is not None
        counts = self.layout_search.pipeline_counts(world)
        shares = [share_of(Layout(world // pp, pp), self.replication) for pp in counts]
        with planned_in_training(target), metrics_kept(self.steps.module):
            return shared_cores(target, *share, self.strategy.optimizers, shares=shares,
                                loss=self._step_loss(hook, batch, rest))

    def _step_loss(self, hook: str, batch: Any, rest: tuple) -> Callable[[Any], torch.Tensor | None] | None:
        """What the last stage's rank computes beyond the model, for the planner to charge
        (:mod:`.step_loss`): the training step's loss; ``None`` for other steps (a sanity check's
        validation batch planning first), whose loss trains nothing."""
        assert self.steps is not None
        return step_loss(self.steps, hook, batch, rest) if hook == TRAINING else None

    def _make_plan(self, target: nn.Module, hook: str, batch: Any, rest: tuple,
                   measured: Mapping[Kind, CollectiveSpeed] | None, capacity: SharedCores | None) -> Any:
        """The plan for the layout given, or for the one the planner chooses on the whole ``batch``
        (weighed on the ``measured`` collectives and the ranks' ``capacity``)."""
        assert self.steps is not None
        strategy, options = self.strategy, self.options
        search = self.layout_search
        loss = self._step_loss(hook, batch, rest)
        if search is not None:  # the module as the step calls it: once per micro-batch, as it is
            args, kwargs = self.steps.call_of(hook, batch, rest)  # type: ignore[misc]
            with torch.enable_grad(), metrics_kept(self.steps.module):
                return plan_layouts(target, args, kwargs, strategy.world_size, self.stage_devices_of, search,
                                    self.links(measured), options, optimizers=strategy.optimizers,
                                    replication=self.replication, shared_cores=capacity, loss=loss,
                                    alternatives=self.layout_trials - 1)
        whole = self.steps.call_of(hook, self._replica_share(batch), rest)
        devices = self.stage_devices_of(self.layout, self.schedule)
        with torch.enable_grad(), metrics_kept(self.steps.module):
            args, kwargs = planning_call(target, *whole, options, count_items=False)
            planned = planned_for_call(target, args, kwargs, devices, options, self.strategy.optimizers, loss)
        planned.plan.regather = self._regather(planned.plan, measured)
        return planned

    def _regather(self, plan: Plan, measured: Mapping[Kind, CollectiveSpeed] | None) -> Regather | None:
        """How FSDP2 gathers in the layout given: the fastest way that fits (see ``chosen_regather``)."""
        devices = self.stage_devices_of(self.layout, self.schedule)
        return chosen_regather(plan, self.schedule, self.layout, self.links(measured), self.replication,
                               devices, self.options.memory_gb)


def _shape_of(micro: list[Any]) -> tuple:
    """What the stages' shapes follow from: the micro-batches' tensor shapes and dtypes."""
    leaves, _ = flatten(micro[0])
    return len(micro), tuple((tuple(v.shape), v.dtype) for v in leaves if isinstance(v, torch.Tensor))


def _model_loss(output: Any) -> Any:
    """The loss a model's output holds (a Hugging Face ``ModelOutput``'s ``loss``), or ``None``."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def _zero_loss(output: Any, device: torch.device) -> torch.Tensor:
    """A loss of 0 that reaches every output that needs a gradient: the schedule runs the backward
    of a micro-batch whose step returned ``None`` too, and it must give no gradient."""
    leaves = [v for v in pytree.tree_leaves(output) if isinstance(v, torch.Tensor) and v.requires_grad]
    return sum(((v * 0).sum() for v in leaves), torch.zeros((), device=device, requires_grad=True))


def _skipped(hook: str, called: int, count: int) -> str:
    part = "" if called == 0 else f" for {count - called} of its {count} micro-batches"
    return (f"{hook} returned None to skip this batch{part}. With schedule=, every stage is a process, and Lightning "
            "skips no batch in a run of several processes (it refuses the same under DDP). Leave out schedule= (one "
            "process drives the stages and skips as plain Lightning does), or train on every batch: filter the data "
            "in the DataLoader instead, or return a loss of 0 (an optimizer with momentum still moves the weights).")

