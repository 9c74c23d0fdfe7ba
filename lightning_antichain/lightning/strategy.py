"""``AntichainPipelineStrategy``: pipeline-parallel training for an unchanged LightningModule.

    trainer = Trainer(strategy=AntichainPipelineStrategy(chunks=8), devices=4)  # or chunks="auto", the default

The strategy profiles the module to pipeline (the LightningModule's own ``forward`` unless
``module=`` names a submodule), plans its stages, and hands the steps to one of two runtimes with
one interface (set up, run a step, backward, optimizer step, give state, tear down): by default
one process drives one pipeline over all the devices Lightning assigns
(:mod:`.in_process_runtime`); with ``schedule=`` each device is a process holding its own stages
(:mod:`.process_runtime`). Here stay what both share: devices and ranks, the launcher, placing
the model, and checkpoints with the original keys as CPU tensors. The user's step, loss, logging,
torchmetrics, optimizers, clipping, accumulation and checkpointing stay as without the strategy.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from ..planner.layout_search import layout_search
from ..planner.planning import AUTO, default_memory_gb
from ..runtime.cpu_threads import stage_threads
from ..runtime.empty_init import init_empty_weights
from ..runtime.initialization import Initializer, ParamInitFn
from ..runtime.layout import Layout
from ..runtime.materialize import has_meta_state, materialize, meta_attributes
from ..runtime.options import PipelineOptions, renamed_recompute
from ..runtime.pipeline import Pipeline
from ..runtime.plan import Plan
from ..runtime.process_schedules import ProcessSchedule, process_schedule
from ..runtime.replication import REPLICATIONS, Replication
from .in_process_runtime import InProcessRuntime
from .planned_pipeline import PlannedPipeline
from .process_runtime import ProcessRuntime, options_for_processes, refuse_other_stage_count
from .replica_batches import replica_loader
from .same_batches import same_order_everywhere
from .strategy_checkpoints import StrategyCheckpoints

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "antichain_pipeline"


class AntichainPipelineStrategy(ParallelStrategy):
    """Train one LightningModule as a micro-batched pipeline over the Trainer's devices.

    Args:
        chunks: micro-batches per batch. A batch must have at least this many samples (a shorter
            last batch of an epoch runs with fewer micro-batches). ``"auto"`` profiles each count
            of :func:`~lightning_antichain.planner.planning.chunk_candidates` at its micro-batch size on the
            first batch and takes the one with the shortest predicted step that fits in memory
            (under ``recompute``); the plan table lists them all.
        recompute: activation recomputation, ``"never"``, ``"except_last"`` or ``"always"``: which
            micro-batches keep only their stage inputs and run their forward again in backward.
            (``checkpoint=`` is its old name, still taken with a warning.)
        module: dotted path of the submodule to pipeline (e.g. ``"backbone"``); default: the
            LightningModule's own ``forward``. Its forward must be what the steps call.
        plan: path of a saved plan JSON to use instead of profiling and planning.
        balance: operations per stage, in execution order, to use instead of planning.
        bandwidth_gbps: link between stages in GB/s for the planner; default free on CPU, 16 on GPU.
        internode_gbps: with ``schedule=``, the link between ranks on two nodes in GB/s, which the
            planner charges the cuts and reductions that cross nodes; default 25 from a GPU (one
            200 Gb/s adapter each), on CPU as ``bandwidth_gbps``.
        memory_gb: memory per device in GB for the planner; default: 90% of each GPU's memory,
            unlimited on CPU.
        optimizer_multiplier: optimizer state per parameter byte for the planner; default: read from
            the configured optimizers (Adam 2, SGD with momentum 1, plain SGD 0).
        deferred_batch_norm: update BatchNorm running statistics once per batch, not per micro-batch.
        leaf_modules: dotted paths of submodules to keep whole when tracing.
        profile_cache: directory of cached profiles; default ``~/.cache/lightning-antichain``.
        use_profile_cache: read and write that cache.
        calibrate: time a few steps of a plan whose stages share the CPU or are all on GPUs, and predict from them
            (:mod:`lightning_antichain.planner.calibration`); seconds once, then cached with the profiles. With
            ``schedule=``, each rank times its actions in steps 2 to 4 instead (planner/process_calibration.py).
        rebalance_rounds: after calibration, cut again on the stage times measured for at most
            this many rounds, keeping the best split measured (0: keep the profile's split).
        cpu_threads: intra-op threads of each CPU stage, which planning profiles with too. Default:
            the cores shared evenly among the CPU stages of all replicas on the node.
        log_stage_times: log each stage's measured busy time of the previous step
            (``pipeline/stage{k}_busy_ms``) from ``training_step``.
        stages: devices per pipeline. Default: all of a node's devices, one pipeline per node. With
            ``devices`` a multiple of it, each group of ``stages`` devices runs a pipeline replica in
            its own process, and replicas average gradients over torch.distributed (gloo on CPU,
            NCCL on GPU), as DDP does. With ``schedule=``: processes per pipeline, on any number of
            nodes (default: one pipeline over all of them); ``devices x num_nodes / stages``
            pipelines train side by side, each on an equal share of every batch (the batch stays
            the step's whole batch, whatever the layout), and torch keeps each stage in step over
            its replicas as ``replication`` says. The ranks form a ``DeviceMesh`` with dims
            ``("dp", "pp")``, ``self.device_mesh`` in ``configure_model()``. ``"auto"`` (with
            ``schedule=``): on the first batch the planner weighs every layout of replicas x
            stages with every micro-batch count, and takes the one predicted fastest that fits in
            memory; the plan table lists each with why it lost. The layout never changes what
            training computes (the replicas split each batch). Its mesh is made then, after
            ``configure_model()``.
        replication: with ``schedule=`` and several pipelines, how each stage is kept in step over
            its replicas: ``"ddp"`` (torch's DDP, the gradients all-reduced during the last
            micro-batch's backward) or ``"fsdp"`` (FSDP2's ``fully_shard``: parameters, gradients
            and optimizer state sharded over the replicas).
        start_method: how replica processes start: ``"popen"`` (re-run the script, as Lightning's
            DDP) or ``"spawn"``/``"fork"`` (notebooks).
        process_group_backend: override the torch.distributed backend.
        batch_dim: the dim of the inputs that holds the samples, as DataParallel's ``dim`` (1 for a
            sequence-first ``nn.GRU``); or a dict by ``forward``'s argument names, others on dim 0.
        check_batch: before the first step, refuse a ``forward`` whose result for a sample depends
            on the rest of its batch (micro-batching would change it). Turn off only where that is
            meant, e.g. a mixture of experts with a capacity per batch.
        placement: for each stage, the index of its device among the pipeline's devices, e.g.
            ``[0, 0, 1, 1]``: four stages on two devices. Default: one stage per device. Stages
            on one device split its memory budget equally; each has its own worker and streams.
        empty_init: build the model in ``LightningModule.configure_model()`` on the meta device,
            without memory, as ``Trainer.init_module(empty_init=True)`` does. The pipelined module
            is then profiled a few operations at a time and made real stage by stage on each
            stage's device, so no device ever holds all of it: the way to train a model bigger
            than one device. Parameters go on meta; buffers keep the values ``__init__`` gives
            them. A checkpoint loaded in ``configure_model()`` (:func:`~lightning_antichain.load_checkpoint`)
            goes straight into the stages; what it does not hold is initialised as
            ``param_init_fn`` says.
        param_init_fn: fills the parameters and buffers a module holds itself, in place, when a
            model built on meta is made real; called once per module, as FSDP1's was. Default: a
            Hugging Face model's own ``_init_weights``, else each module's ``reset_parameters()``.
        schedule: run one process per device, each holding its stages, under this schedule of
            ``torch.distributed.pipelining``: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zb-h1"`` or ``"zbv"``. Lightning (or ``torchrun``, or SLURM) starts the processes
            as for DDP, and every rank gets the same batches. The step hooks then run once per
            micro-batch on the last stage's rank (see docs/strategy.md). ``"auto"``: the planner
            chooses among them with the layout (as ``stages="auto"`` does). Default ``None``: one
            process drives every stage, GPipe's schedule in worker threads.
        virtual_stages: stages per process for ``"interleaved-1f1b"`` and ``"zb-h1"`` (default 2
            and 1); ``"zbv"`` holds 2.
        save_distributed_checkpoint: save a checkpoint as a directory of
            ``torch.distributed.checkpoint`` shards, each rank writing its own stages' weights and
            optimizer state, as Lightning's ``ModelParallelStrategy`` does; ``False``: one file,
            gathered on rank 0. Default: shards with ``schedule=``, one file without. Either loads
            into any stage count, schedule or runtime; ``lightning-antichain consolidate DIR`` makes
            shards one file for plain Lightning.
        compile_stages: run each stage's graph through ``torch.compile``: ``True`` with its
            defaults, or a dict of its arguments (``{"mode": "reduce-overhead"}``: CUDA graphs,
            which take the host's launches out of a step). Each stage compiles on its first
            micro-batch. Planning and calibration time the stages uncompiled.
    """

    strategy_name = "antichain_pipeline"

    def __init__(
        self,
        chunks: int | Literal["auto"] = "auto",
        recompute: Literal["never", "except_last", "always"] = "never",
        module: str | None = None,
        plan: str | None = None,
        balance: list[int] | None = None,
        bandwidth_gbps: float | None = None,
        internode_gbps: float | None = None,
        memory_gb: float | None = None,
        optimizer_multiplier: float | None = None,
        deferred_batch_norm: bool = False,
        leaf_modules: list[str] | None = None,
        profile_cache: str | None = None,
        use_profile_cache: bool = True,
        calibrate: bool = True,
        rebalance_rounds: int = 3,
        cpu_threads: int | None = None,
        log_stage_times: bool = False,
        stages: int | Literal["auto"] | None = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        process_group_backend: str | None = None,
        batch_dim: int | dict[str, int] = 0,
        check_batch: bool = True,
        placement: list[int] | None = None,
        empty_init: bool = False,
        param_init_fn: ParamInitFn | None = None,
        schedule: str | None = None,
        virtual_stages: int | None = None,
        save_distributed_checkpoint: bool | None = None,
        replication: Replication = "ddp",
        checkpoint: Literal["never", "except_last", "always"] | None = None,
        compile_stages: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        recompute = renamed_recompute(recompute, checkpoint)
        if plan is not None and balance is not None:
            raise ValueError("give either plan= or balance=, not both")
        #: the planning and runtime settings, handed as one object to the planner and the Pipeline
        self.options = PipelineOptions(
            chunks=chunks, recompute=recompute, batch_dim=batch_dim, check_batch=check_batch,
            leaf_modules=tuple(leaf_modules or ()), deferred_batch_norm=deferred_batch_norm,
            balance=None if balance is None else tuple(balance), bandwidth_gbps=bandwidth_gbps,
            internode_gbps=internode_gbps, memory_gb=memory_gb,
            optimizer_multiplier=optimizer_multiplier, profile_cache=Path(profile_cache) if profile_cache else None,
            use_profile_cache=use_profile_cache, calibrate=calibrate, rebalance_rounds=rebalance_rounds,
            cpu_threads=cpu_threads, param_init_fn=param_init_fn, compile_stages=compile_stages,
        )
        #: what the planner chooses of the layout of stages as processes (stages= or schedule="auto")
        self.layout_search = layout_search(stages, schedule, virtual_stages) if schedule is not None else None
        if schedule is None and stages == AUTO:
            raise ValueError('stages="auto" chooses the layout of stages as processes: give schedule= too (a name, or '
                             '"auto" to choose it as well)')
        if self.layout_search is not None and (plan is not None or balance is not None):
            raise ValueError('stages="auto" and schedule="auto" plan the layout: leave out plan= and balance=, or give '
                             "stages= and schedule= as you planned them")
        #: one process per device under this schedule (a stand-in until planned, for "auto"), or
        #: ``None``: one process, GPipe in threads
        self.process_schedule = None if schedule is None else (
            self.layout_search.schedules[0] if self.layout_search is not None else process_schedule(schedule,
                                                                                                    virtual_stages))
        if self.process_schedule is not None:
            self.options = options_for_processes(self.options, self.process_schedule, placement)
        elif virtual_stages is not None:
            raise ValueError("virtual_stages= is for schedule='interleaved-1f1b', 'zb-h1' or 'zbv'")
        if replication not in REPLICATIONS:
            raise ValueError(f"replication={replication!r} is not one of {', '.join(map(repr, REPLICATIONS))}")
        self.module_path = module
        if placement is not None and (not placement or any(not isinstance(i, int) or i < 0 for i in placement)):
            raise ValueError(f"placement must list a device index (0, 1, ...) for each stage, got {placement}")
        self.placement = None if placement is None else list(placement)
        self._device_memory_gb = memory_gb
        self.empty_init = empty_init
        self.plan_path = plan
        self.log_stage_times = log_stage_times
        if stages is not None and stages != AUTO and (not isinstance(stages, int) or stages < 1):
            raise ValueError(f'stages must be a whole number of at least 1, or "auto", got {stages!r}')
        self.stages = stages
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        self._num_nodes = 1
        #: the plan and the Pipeline of the module pipelined, made on its first batch
        self._planned = PlannedPipeline(self, self.options, plan)
        #: what runs the steps: one process driving every stage, or this rank's stages as a process
        self._runtime: InProcessRuntime | ProcessRuntime = (
            InProcessRuntime(self, self._planned, log_stage_times) if self.process_schedule is None
            else ProcessRuntime(self, self.options, self.process_schedule, calibrate=calibrate,
                                replication=replication))
        self._device_mesh: Any = None
        self._layout: Layout | None = None
        #: checkpoints of the plain module's keys: one file, or shards from every rank
        self.checkpoints = StrategyCheckpoints(self._runtime, self.process_schedule is not None if (
            save_distributed_checkpoint is None) else save_distributed_checkpoint)

    # -- one process, several devices ----------------------------------------------------------

    @property
    def pipeline(self) -> Pipeline | None:
        """The running pipeline (after the first forward or setup), for inspection."""
        return self._planned.pipeline

    @property
    def plan(self) -> Plan | None:
        """The plan the pipeline runs (``None`` before the first batch, unless ``plan=`` gave one)."""
        return self._runtime.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._runtime.plan = plan

    @property
    def tasks_run(self) -> Counter[tuple[int, int]]:
        """Micro-batch tasks this strategy's pipelines ran, by stage and worker thread (see
        :attr:`Pipeline.tasks_run`), over every ``fit``/``validate``/``test``/``predict`` so far."""
        current = self.pipeline.tasks_run if self.pipeline is not None else Counter()
        before = self._runtime.tasks_before if isinstance(self._runtime, InProcessRuntime) else Counter()
        return before + current

    @property
    def stages_per_replica(self) -> int:
        """Devices in one process's pipeline: ``stages``, or all the devices of a node (one, where
        each stage is a process)."""
        if self.process_schedule is not None:
            return 1
        return self.stages or len(self.parallel_devices or [None])

    @property
    def num_processes(self) -> int:
        """Pipeline replicas (processes) per node."""
        return max(len(self.parallel_devices or []) // self.stages_per_replica, 1)

    @property
    def is_distributed(self) -> bool:
        """More than one pipeline replica: Lightning then shards the data with a DistributedSampler.
        Where each stage is a process, every process gets the same batches (replicas split each)."""
        return self.multi_process and self.process_schedule is None

    @property
    def layout(self) -> Layout:
        """With ``schedule=``: how the ranks form pipelines of ``stages`` processes and their
        replicas (for ``stages="auto"``, once planned on the first batch)."""
        if self._layout is None:
            if self.layout_search is not None:
                raise RuntimeError('stages="auto" chooses the layout on the first batch')
            self._layout = Layout.of(self.world_size, self.stages if self.process_schedule is not None else None)
        return self._layout

    def use_layout(self, layout: Layout) -> None:
        """Run ``layout``: make its mesh (every rank calls it)."""
        self._layout = layout
        self._device_mesh = layout.mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def stage_devices_of(self, layout: Layout, schedule: ProcessSchedule) -> list[torch.device]:
        """Where each stage of the first pipeline of ``layout`` under ``schedule`` runs: its rank's device."""
        assert self.parallel_devices
        per_node = len(self.parallel_devices)
        return [self.parallel_devices[layout.rank(0, schedule.rank_of(s, layout.pp)) % per_node]
                for s in range(schedule.num_stages(layout.pp))]

    @property
    def device_mesh(self) -> Any:
        """With ``schedule=``: the ranks' ``DeviceMesh``, dims ``("dp", "pp")`` (after setup_environment)."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh is made in setup_environment (with schedule= only)")
        return self._device_mesh

    @property
    def multi_process(self) -> bool:
        """More than one process: pipeline replicas, or stages as processes."""
        return self.num_nodes * self.num_processes > 1

    @property
    def pipeline_devices(self) -> list[torch.device]:
        """The devices of this process's pipeline."""
        assert self.parallel_devices, "the Trainer has not assigned devices yet"
        first = self.local_rank * self.stages_per_replica
        return list(self.parallel_devices[first : first + self.stages_per_replica])

    @property
    def stage_devices(self) -> list[torch.device]:
        """The device of each stage: one stage per pipeline device, or as ``placement`` says."""
        devices = self.pipeline_devices
        return devices if self.placement is None else [devices[i] for i in self.placement]

    @property
    @override
    def root_device(self) -> torch.device:
        return self.stage_devices[0]


    @property
    @override
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.multi_process and self.cluster_environment else 0

    @property
    @override
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.multi_process and self.cluster_environment else 0

    @property
    @override
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.multi_process and self.cluster_environment else 0

    @property
    @override
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be at least 1, got {num_nodes}")
        self._num_nodes = num_nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        if self.process_schedule is not None:  # every rank gets the whole batch; replicas split it
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With ``schedule=``: the same order in every process (:mod:`.same_batches`), and, where
        replicas of a pipeline train side by side in a layout given (not planned), each replica's
        share of every batch only (:mod:`.replica_batches`)."""
        if self.process_schedule is None:
            return dataloader
        dataloader = same_order_everywhere(dataloader)
        if self.layout_search is not None or self.layout.dp == 1:
            return dataloader
        return replica_loader(dataloader, self.layout.dp, self.layout.replica(self.global_rank))

    @override
    def _configure_launcher(self) -> None:
        if not self.multi_process:
            return  # one pipeline: Lightning runs in this process
        assert self.cluster_environment is not None
        if self.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None and self.multi_process:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.world_size)
            rank_zero_only.rank = self.global_rank

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self._runtime.optimizer_step(optimizer, closure, model, **kwargs)

    # -- setup ---------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        if not self.parallel_devices:
            raise ValueError("AntichainPipelineStrategy got no devices from the Trainer")
        devices = len(self.parallel_devices)
        if devices % self.stages_per_replica:
            raise ValueError(
                f"devices={devices} is not a multiple of stages={self.stages}; each pipeline replica needs "
                f"{self.stages} devices"
            )
        if self.placement is not None and max(self.placement) >= self.stages_per_replica:
            raise ValueError(
                f"placement={self.placement} names device {max(self.placement)}, but each pipeline has "
                f"{self.stages_per_replica} devices (0 to {self.stages_per_replica - 1}); give more devices or "
                "name fewer"
            )
        if self.options.cpu_threads is None and self.num_processes > 1:  # replicas share the node's cores too
            self.options = self._planned.options = self.options.replace(
                cpu_threads=stage_threads(self.parallel_devices))
        stages = self._requested_stages()
        what = "the plan" if self.plan_path else "the balance"
        if stages is not None and self.process_schedule is not None:
            refuse_other_stage_count(stages, self.process_schedule, self.layout.pp, what)
        elif stages is not None and stages != len(self.stage_devices):
            if self.placement is not None:
                raise ValueError(f"{what} has {stages} stages but placement={self.placement} has "
                                 f"{len(self.placement)}; give one device index per stage")
            raise ValueError(
                f"{what} has {stages} stages but the Trainer gives {self.stages_per_replica} devices per pipeline; "
                f"set devices={stages} (one device per stage), or placement= with a device for each of {stages} stages"
            )
        if self.placement is not None:
            self._share_device_memory()
        if self.process_schedule is None:  # CPU devices are one torch device: name each stage's
            self.options = self._planned.options = self.options.replace(device_slots=tuple(
                self.placement or range(self.stages_per_replica)))
        if self.multi_process or self.process_schedule is not None:  # stages as processes talk even alone
            self.set_world_ranks()
            backend = self.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            _init_dist_connection(self.cluster_environment, backend)
        super().setup_environment()
        if self.process_schedule is not None and self.layout_search is None:
            self.use_layout(self.layout)  # configure_model() may shard or parallelise within a stage

    def _share_device_memory(self) -> None:
        """Stages placed on one device split its memory budget equally (``memory_gb`` per device)."""
        assert self.placement is not None
        devices = self.pipeline_devices
        given = self._device_memory_gb
        per_device = (list(given) if isinstance(given, tuple) else [given] * len(devices)) if given is not None else (
            default_memory_gb(devices))
        if len(per_device) != len(devices):
            raise ValueError(f"memory_gb lists {len(per_device)} values for {len(devices)} devices")
        sharing = Counter(self.placement)
        self.options = self.options.replace(memory_gb=tuple(
            None if per_device[i] is None else per_device[i] / sharing[i] for i in self.placement))
        self._planned.options = self.options

    def _requested_stages(self) -> int | None:
        if self.options.balance is not None:
            return len(self.options.balance)
        if self.plan_path is not None:
            self.plan = Plan.load(self.plan_path)
            return self.plan.num_stages
        return None

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Tensors made inside go to the root device; with ``empty_init`` (the strategy's own,
        where Lightning passes none, as for ``configure_model()``) parameters go to the meta device
        and buffers keep the values ``__init__`` computes (:func:`~lightning_antichain.init_empty_weights`)."""
        if not (self.empty_init if empty_init is None else empty_init):
            with super().tensor_init_context(empty_init):
                yield
            return
        with init_empty_weights(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        """Move the LightningModule to the root device, except the pipelined module's parameters and
        buffers: each stage goes from where it is (the CPU, or the meta device) straight to its own
        device when the pipeline is built, so the root device never holds the whole model. What
        no stage uses follows to the root device then (:meth:`_place_leftovers`). Meta tensors
        outside the pipelined module (a loss module, a head around a pipelined backbone) are made
        real on the root device by their modules' ``reset_parameters()``."""
        module = self.lightning_module
        assert module is not None
        unknown = meta_attributes(module)
        if unknown:
            raise ValueError(
                f"{type(module).__name__} holds tensors on the meta device that are not parameters or buffers "
                f"({', '.join(unknown[:4])}): nothing knows how to make them real. Build these (torchmetrics "
                "metrics, say) outside the meta context: empty_init and Trainer.init_module(empty_init=True) are for "
                "the network; create metrics in __init__ and the network in configure_model()."
            )
        target = self.target()
        staying = {id(t) for t in [*target.parameters(), *target.buffers()]}
        staying |= {id(p.grad) for p in target.parameters() if p.grad is not None}
        module._apply(lambda t: t if t.is_meta or id(t) in staying else t.to(self.root_device))
        _update_properties(module, device=self.root_device)  # what Module.to(root) would have recorded
        inside = {id(m) for m in target.modules()}
        outside = [m for m in module.modules() if id(m) not in inside]
        materialize(outside, self.root_device, "reset", Initializer(module, self.options.param_init_fn))

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._runtime.setup(trainer)

    def target(self) -> nn.Module:
        """The module pipelined: the LightningModule, or its submodule ``module=``."""
        module = self.lightning_module
        assert module is not None
        if self.module_path is None:
            return module
        try:
            return module.get_submodule(self.module_path)
        except AttributeError:
            raise AttributeError(
                f"{type(module).__name__} has no submodule {self.module_path!r} to pipeline (module=...)"
            ) from None

    # -- steps ---------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._runtime.step("predict_step", args, kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._runtime.backward(closure_loss, optimizer, *args, **kwargs)

    def describe_target(self) -> str:
        return f"{type(self.lightning_module).__name__}.forward" if self.module_path is None else self.module_path

    # -- checkpoints ---------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The original keys, as CPU tensors: loadable with any device count, or without the strategy."""
        return self.checkpoints.model_state(super().lightning_module_state_dict())

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's whole trained ``state_dict``, as CPU tensors, on global rank 0.

        With ``schedule=``, a rank holds only its own stages' parameters; the others' are on the
        meta device there (see docs/strategy.md, "What a rank holds"). Every rank must call this
        (it gathers each tensor from the rank that trains it); rank 0 gets the whole state, ready
        for ``torch.save`` or ``model.load_state_dict``, and the other ranks their own view, as
        ``model.state_dict()`` gives it. In process, it is the module's state on the CPU."""
        assert self.lightning_module is not None
        return self.checkpoints.whole_model_state(self.lightning_module.state_dict())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.checkpoints.optimizer_state(self.optimizers, optimizer, super().optimizer_state(optimizer))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint_path = self.broadcast(checkpoint_path)
        return self.checkpoints.read(checkpoint_path) or super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.checkpoints.load_model(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.checkpoints.load_optimizers(self.optimizers, checkpoint["optimizer_states"])

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduction between replicas while Lightning accumulates gradients (in process; the
        process runtime's DDP reduces in every step's last backward)."""
        with self._runtime.block_backward_sync():
            yield

    def stages_placed(self) -> None:
        """Each stage is real on its device (called by the runtime)."""
        self._runtime.stages_placed()
        self.checkpoints.stages_placed(self.optimizers)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """One file from rank 0, or (``save_distributed_checkpoint``) a directory of shards, each
        rank writing its share."""
        if self.plan is not None:
            checkpoint[CHECKPOINT_KEY] = {
                "chunks": self.plan.chunks,
                "requested_chunks": self.options.chunks,
                "devices": [str(d) for d in self.parallel_devices or []],
                "replicas": self.world_size,
                "plan": self.plan.to_dict(),
            }
        filepath = self.broadcast(filepath)  # every rank writes where rank 0 says
        if not self.checkpoints.saved_as_shards(checkpoint, filepath, storage_options):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # a remote path, too

    @override
    def teardown(self) -> None:
        self._runtime.teardown()
        for optimizer in self.optimizers:
            _optimizer_to_device(optimizer, torch.device("cpu"))
        module = self._lightning_module
        if module is None or not has_meta_state(module):
            super().teardown()
            return
        # a run stopped before its stages were placed: what is real goes to the CPU, meta stays
        # meta (Lightning's Module.cpu() would fail on it and hide the error that stopped the run)
        module._apply(lambda t: t if t.is_meta else t.cpu())
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Antichain-DAG pipeline parallelism over the Trainer's devices in one process",
        )


def register() -> None:
    """Make ``strategy="antichain_pipeline"`` work; called when the package is imported."""
    if AntichainPipelineStrategy.strategy_name not in StrategyRegistry:
        AntichainPipelineStrategy.register_strategies(StrategyRegistry)
