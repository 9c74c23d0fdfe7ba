"""``AntichainPipelineStrategy``: pipeline-parallel training for an unchanged LightningModule.

    trainer = Trainer(strategy=AntichainPipelineStrategy(chunks=8), devices=4)

It plans the stages of the module it pipelines and hands the steps to the :class:`~.runtime.Runtime` it
chooses when it is made: one process driving every stage in threads (the default), or one process
per stage under ``schedule=``. Here stays what Lightning asks of any strategy: devices, placing the
module, and checkpoints with the plain module's keys. Ranks and launching: :mod:`.process_ranks`.
"""

from __future__ import annotations

import atexit
from collections import Counter
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from ..in_process.in_process_runtime import InProcessRuntime
from ..plans.options import AUTO
from ..plans.plan import Plan
from ..processes.process_runtime import ProcessRuntime
from ..processes.rank_faults import StageProcessError
from ..processes.replication import Replication
from ..weights.empty_init import init_empty_weights
from ..weights.held_elsewhere import explain_meta_read
from ..weights.initialization import ParamInitFn
from ..weights.materialize import has_meta_state
from .module_placement import real_to_cpu, to_root_device
from .process_ranks import ProcessesStrategy, group_timeout
from .runtime import Runtime
from .strategy_checkpoints import StrategyCheckpoints
from .strategy_options import current_arguments, pipeline_options, process_options, run_options

CHECKPOINT_KEY = "antichain_pipeline"


class AntichainPipelineStrategy(ProcessesStrategy):
    """Train one LightningModule as a micro-batched pipeline over the Trainer's devices.

    docs/strategy.md tells what each option does at length; in short:

    Args:
        chunks: micro-batches per batch; ``"auto"``: the planner weighs each count on the first batch.
        recompute: activation recomputation, ``"never"``, ``"except_last"`` (in process) or ``"always"``.
        module: dotted path of the submodule to pipeline (default: the LightningModule's ``forward``).
        plan: path of a saved plan JSON to run instead of planning.
        balance: operations per stage, in execution order, instead of planning.
        method: the planner: ``"antichain"`` (the DP over the antichain DAG), or a baseline for
            comparison: ``"uniform"``, ``"parameters"``, ``"blocks"``.
        bandwidth_gbps: the link between stages in GB/s (default: free on CPU, 16 on GPU).
        internode_gbps: with ``schedule=``, the link between nodes in GB/s (default 25 from a GPU).
        memory_gb: memory per device in GB for the planner (default: 90% of a GPU's; unlimited on CPU).
        optimizer_multiplier: optimizer state per parameter byte (default: from the optimizers).
        deferred_batch_norm: update BatchNorm running statistics once per batch, not per micro-batch.
        leaf_modules: dotted paths of submodules to keep whole when capturing.
        profile_cache: the directory of cached profiles (default ``~/.cache/lightning-antichain``),
            or ``False``: profile afresh every time, caching nothing.
        calibrate: time the first steps and predict from them (cached with the profiles).
        rebalance_rounds: in process, cut again on the measured stage times at most this many
            times (default 3; 0: keep the profile's split).
        cpu_threads: intra-op threads of each CPU stage (default: the cores shared evenly).
        log_stage_times: in process, log each stage's busy time of the previous step.
        pipeline_parallel_size: devices (in process) or processes (``schedule=``) per pipeline;
            ``devices x num_nodes`` over it is the count of pipeline replicas (default: one
            pipeline per node in process, one over every rank with ``schedule=``). ``"auto"``
            (with ``schedule=``): the planner weighs every layout on the first batch.
        replication: with ``schedule=`` and replicas: ``"ddp"`` (default) or ``"fsdp"`` (FSDP2).
        layout_trials: where the planner weighs the layouts (``"auto"``): time this many of those
            predicted fastest on the first batch, a few steps each, and train the fastest measured
            (default: the prediction's choice). The trial steps change nothing that training computes.
        start_method: how processes start: ``"popen"`` (as Lightning's DDP), ``"spawn"``, ``"fork"``.
        process_group_backend: override the torch.distributed backend.
        timeout: how long a rank waits on another (a transfer between stages, a collective) before it
            stops with an error naming what it waited for: seconds or a ``timedelta`` (default
            torch's, 30 minutes), as Lightning's DDP takes it.
        batch_dim: the inputs' dim holding the samples, or a dict of them by argument name.
        check_batch: refuse a ``forward`` whose samples depend on each other.
        placement: in process, each stage's device index among the pipeline's, e.g. ``[0, 0, 1, 1]``.
        empty_init: build the model in ``configure_model()`` on meta; each stage is made real on its device.
        param_init_fn: fills a module's new tensors when a model on meta is made real.
        schedule: one process per device under this ``torch.distributed.pipelining`` schedule:
            ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``, ``"zbv"`` or ``"auto"``.
            Default ``None``: one process drives every stage, GPipe's schedule in threads.
        virtual_stages: stages per process for ``"interleaved-1f1b"`` and ``"zb-h1"`` (``"zbv"`` holds 2).
        save_distributed_checkpoint: save shards per rank (default with ``schedule=``) or one file.
        compile_stages: run each stage's graph through ``torch.compile`` (``True``, or its arguments).
    """

    strategy_name = "antichain_pipeline"

    def __init__(
        self,
        chunks: int | Literal["auto"] = "auto",
        recompute: Literal["never", "except_last", "always"] = "never",
        module: str | None = None,
        plan: str | None = None,
        balance: list[int] | None = None,
        method: Literal["antichain", "uniform", "parameters", "blocks"] = "antichain",
        bandwidth_gbps: float | None = None,
        internode_gbps: float | None = None,
        memory_gb: float | None = None,
        optimizer_multiplier: float | None = None,
        deferred_batch_norm: bool = False,
        leaf_modules: list[str] | None = None,
        profile_cache: str | bool = True,
        calibrate: bool = True,
        rebalance_rounds: int = 3,
        cpu_threads: int | None = None,
        log_stage_times: bool = False,
        pipeline_parallel_size: int | Literal["auto"] | None = None,
        replication: Replication = "ddp",
        layout_trials: int | None = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = None,
        batch_dim: int | dict[str, int] = 0,
        check_batch: bool = True,
        placement: list[int] | None = None,
        empty_init: bool = False,
        param_init_fn: ParamInitFn | None = None,
        schedule: str | None = None,
        virtual_stages: int | None = None,
        save_distributed_checkpoint: bool | None = None,
        compile_stages: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        arguments = current_arguments(AntichainPipelineStrategy.__init__, locals())
        self.module_path = module
        self.placement = None if placement is None else list(placement)
        self.empty_init = empty_init
        self.plan_path = plan
        #: devices (in process) or processes (schedule=) per pipeline, as given
        self.pipeline_parallel_size = pipeline_parallel_size
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        #: how long a rank waits on another before it stops (every process group the strategy makes)
        self.timeout = group_timeout(timeout)
        self._num_nodes = 1
        processes = process_options(arguments)
        #: the planning and running settings as given; each run reads them resolved for its devices
        self._given_options = pipeline_options(arguments, processes)
        #: the settings every part reads: as given until the Trainer sets the strategy up, then
        #: those of the run (:func:`~.strategy_options.run_options`)
        self.options = self._given_options
        #: what runs the steps, chosen once: one process driving every stage, or a process per stage
        self._runtime: Runtime = InProcessRuntime(self, log_stage_times) if processes is None else (
            ProcessRuntime(self, processes))
        #: checkpoints of the plain module's keys: one file, or shards from every rank
        self.checkpoints = StrategyCheckpoints(self._runtime.holdings, self._runtime.holdings.sharded_by_default if (
            save_distributed_checkpoint is None) else save_distributed_checkpoint)

    @property
    def pipeline(self) -> Any:
        """What runs this process's stages (after the first forward or setup), for inspection: a
        :class:`~lightning_antichain.in_process.pipeline.Pipeline` in process."""
        return self._runtime.pipeline

    @property
    def plan(self) -> Plan | None:
        """The plan the pipeline runs (``None`` before the first batch, unless ``plan=`` gave one)."""
        return self._runtime.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._runtime.plan = plan

    @property
    def tasks_run(self) -> Counter[tuple[int, int]]:
        """Micro-batch tasks the in-process pipelines ran, by stage and worker thread (see
        :attr:`Pipeline.tasks_run`), over every ``fit``/``validate``/``test``/``predict`` so far."""
        runtime = self._runtime
        return runtime.tasks_run if isinstance(runtime, InProcessRuntime) else Counter()

    @property
    def devices_per_pipeline(self) -> int:
        """Devices this process drives: its pipeline's (in process), or one (a process per stage)."""
        return self._runtime.ranks.devices_per_process(
            None if self.pipeline_parallel_size == AUTO else self.pipeline_parallel_size,
            len(self.parallel_devices or [None]))

    @property
    def is_distributed(self) -> bool:
        """Whether Lightning shards the data over the processes with a DistributedSampler: for
        replicas of an in-process pipeline; where each stage is a process, every process gets
        the same batches (replicas split each)."""
        return self._runtime.ranks.shards_data

    @property
    def device_mesh(self) -> Any:
        """With ``schedule=``: the ranks' ``DeviceMesh``, dims ``("dp", "pp")`` (after setup_environment)."""
        mesh = self._runtime.ranks.device_mesh
        if mesh is None:
            raise RuntimeError("the device mesh is made in setup_environment, with schedule= only")
        return mesh

    @property
    def pipeline_devices(self) -> list[torch.device]:
        """The devices this process drives."""
        assert self.parallel_devices, "the Trainer has not assigned devices yet"
        first = self.local_rank * self.devices_per_pipeline
        return list(self.parallel_devices[first : first + self.devices_per_pipeline])

    @property
    def stage_devices(self) -> list[torch.device]:
        """The device of each stage: one stage per pipeline device, or as ``placement`` says."""
        devices = self.pipeline_devices
        return devices if self.placement is None else [devices[i] for i in self.placement]

    @property
    @override
    def root_device(self) -> torch.device:
        return self.stage_devices[0]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._runtime.ranks.process_dataloader(dataloader)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self._runtime.optimizer_step(optimizer, closure, model, super().optimizer_step, **kwargs)

    @override
    def setup_environment(self) -> None:
        if not self.parallel_devices:
            raise ValueError("AntichainPipelineStrategy got no devices from the Trainer")
        devices, per_pipeline = len(self.parallel_devices), self.devices_per_pipeline
        if devices % per_pipeline:
            raise ValueError(f"devices={devices} is not a multiple of pipeline_parallel_size={per_pipeline}; each "
                             f"pipeline replica needs {per_pipeline} devices")
        self._runtime.ranks.check_devices(self._requested_stages(), "the plan" if self.plan_path else "the balance")
        if self.multi_process or self._runtime.ranks.needs_process_group:
            self.set_world_ranks()
            backend = self.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            if not torch.distributed.is_initialized():
                _init_dist_connection(self.cluster_environment, backend, timeout=self.timeout)
                # Lightning destroys NCCL's groups at exit, not gloo's: a step's transfers that gloo's
                # workers still hold, freed while the interpreter finalizes, abort the process (SIGABRT,
                # "terminate called without an active exception")
                atexit.register(_destroy_dist_connection)
        super().setup_environment()
        self._runtime.ranks.environment_ready()

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
        """Tensors made inside go to the root device; with ``empty_init`` (the strategy's where
        Lightning passes none), to meta (:func:`~lightning_antichain.init_empty_weights`)."""
        if not (self.empty_init if empty_init is None else empty_init):
            with super().tensor_init_context(empty_init):
                yield
            return
        with init_empty_weights(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        """The LightningModule to the root device, but the pipelined module's tensors: each stage
        goes to its own device when the pipeline is built (:mod:`.module_placement`)."""
        assert self.lightning_module is not None
        to_root_device(self.lightning_module, self.target(), self.root_device, self.options.param_init_fn)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        assert self.parallel_devices is not None
        self.options = run_options(self._given_options, devices=self.parallel_devices,
                                   pipeline_devices=self.pipeline_devices, slots=self._runtime.ranks.stage_slots(),
                                   processes=self.num_processes,
                                   accumulate_grad_batches=trainer.accumulate_grad_batches)
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

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.step("training_step", args, kwargs, super().training_step)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.step("validation_step", args, kwargs, super().validation_step)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._runtime.step("test_step", args, kwargs, super().test_step)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._runtime.step("predict_step", args, kwargs, super().predict_step)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._runtime.backward(closure_loss, optimizer, super().backward, *args, **kwargs)

    def describe_target(self) -> str:
        return f"{type(self.lightning_module).__name__}.forward" if self.module_path is None else self.module_path

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
        rank writing its share (for one file too, where ranks hold shares: rank 0 joins them)."""
        if self.plan is not None:
            checkpoint[CHECKPOINT_KEY] = {"chunks": self.plan.chunks, "requested_chunks": self.options.chunks,
                                          "devices": [str(d) for d in self.parallel_devices or []],
                                          "replicas": self.world_size, "plan": self.plan.to_dict()}
        filepath = self.broadcast(filepath)  # every rank writes where rank 0 says
        whole = self.checkpoints.one_file(checkpoint, filepath, storage_options, self.broadcast)
        if whole is not None:
            super().save_checkpoint(whole, filepath, storage_options)  # a remote path, too

    @override
    def on_exception(self, exception: BaseException) -> None:
        if not isinstance(exception, StageProcessError):  # another rank's error: its own rank explains it
            explain_meta_read(exception, self._lightning_module)
        self._runtime.failed(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._runtime.teardown()
        for optimizer in self.optimizers:
            _optimizer_to_device(optimizer, torch.device("cpu"))
        module = self._lightning_module
        if module is None or not has_meta_state(module):
            super().teardown()
            return
        real_to_cpu(module)
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

