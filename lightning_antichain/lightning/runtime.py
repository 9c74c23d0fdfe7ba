"""The one interface between the strategy and what runs its pipeline: a :class:`Runtime`.

The strategy holds what Lightning asks of any strategy (devices, ranks, the launcher, placing the
module, checkpoints) and chooses its runtime once, when it is made; from then on it only calls
this interface, as torch's ``_PipelineSchedule`` has one method each schedule implements. Two
runtimes implement it: one process driving every stage of its pipeline in threads
(:class:`~lightning_antichain.in_process.in_process_runtime.InProcessRuntime`, the default) and one
process per stage on ``torch.distributed.pipelining``
(:class:`~lightning_antichain.processes.process_runtime.ProcessRuntime`, ``schedule=``).

Each method whose plain-Lightning behaviour a runtime may keep gets it as ``plain``: the
strategy's inherited method, bound, so no runtime calls Lightning's ``Strategy`` on the strategy
from outside.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import nn

from ..plans.options import PipelineOptions
from ..plans.plan import Plan


class Host(Protocol):
    """What a runtime may ask of the strategy it runs for (the strategy is the one host): its
    module, devices and ranks, optimizers and precision, and its options, one copy."""

    options: PipelineOptions
    plan_path: str | None
    module_path: str | None
    placement: list[int] | None
    lightning_module: Any
    optimizers: list[Any]
    precision_plugin: Any
    timeout: timedelta

    @property
    def root_device(self) -> torch.device: ...
    @property
    def parallel_devices(self) -> list[torch.device] | None: ...
    @property
    def pipeline_devices(self) -> list[torch.device]: ...
    @property
    def stage_devices(self) -> list[torch.device]: ...
    @property
    def devices_per_pipeline(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def is_distributed(self) -> bool: ...
    @property
    def multi_process(self) -> bool: ...

    def target(self) -> nn.Module:
        """The module pipelined."""

    def describe_target(self) -> str: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def stages_placed(self) -> None:
        """Each stage is real on its device now: what waited for it (optimizer state) goes in."""

    def pre_backward(self, closure_loss: torch.Tensor) -> None: ...

    def post_backward(self, closure_loss: torch.Tensor) -> None: ...


class Ranks(ABC):
    """How a runtime lays its stages over processes and devices: what the strategy asks of it
    while Lightning starts the processes and hands out the data."""

    @abstractmethod
    def devices_per_process(self, requested: int | None, node_devices: int) -> int:
        """How many of a node's ``node_devices`` one process drives (``requested``: the
        strategy's ``pipeline_parallel_size``)."""

    @property
    @abstractmethod
    def shards_data(self) -> bool:
        """Whether Lightning gives each process its own share of the data (as under DDP)."""

    @property
    def needs_process_group(self) -> bool:
        """Whether torch.distributed starts even for one process."""
        return False

    @abstractmethod
    def check_devices(self, stages: int | None, what: str) -> None:
        """Before the processes connect: a clear error where the devices cannot run ``what`` (a
        plan or balance given, of ``stages`` stages; ``None``: planned later)."""

    def environment_ready(self) -> None:  # noqa: B027 (a runtime may need nothing then)
        """The processes are connected and the strategy knows its devices."""

    def process_dataloader(self, dataloader: object) -> object:
        """The loader a process iterates (``dataloader``: as Lightning made it)."""
        return dataloader

    @property
    def device_mesh(self) -> Any:
        """The ranks' ``DeviceMesh`` where the runtime makes one (else ``None``)."""
        return None

    def stage_slots(self) -> tuple[int, ...] | None:
        """Which of this process's devices each stage runs on, where stages on one torch device
        stand for different ones (CPU devices); ``None``: one stage per process."""
        return None


class Holdings:
    """What a rank holds of the module and its optimizers, as checkpoints save it: here, all of
    it (one process drives every stage); a runtime whose ranks hold shares overrides each."""

    #: whether checkpoints are shards unless ``save_distributed_checkpoint`` says
    sharded_by_default = False
    #: whether ranks hold different shares (so that even one file is made from each rank's)
    spread = False

    def gathered_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The module's ``state`` whole on rank 0, for :meth:`full_state_dict` (every rank calls it)."""
        return state

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of the module's ``state`` in a checkpoint."""
        return state

    def own_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of ``optimizer``'s state in a checkpoint."""
        return state

    def stepped(self, optimizer: Any) -> set[int] | None:
        """The indices of the parameters of ``optimizer`` this rank steps (``None``: all)."""
        return None


class Runtime(ABC):
    """Runs a LightningModule's steps through a planned pipeline, for the strategy ``strategy``:
    its :attr:`ranks` (processes and devices) and :attr:`holdings` (what checkpoints save), the
    plan and the pipeline, and the hooks of a run."""

    def __init__(self, strategy: Host, ranks: Ranks, holdings: Holdings) -> None:
        self.strategy = strategy
        #: how the stages lie over processes and devices
        self.ranks = ranks
        #: what this rank holds, as checkpoints save it
        self.holdings = holdings

    # -- the plan and the pipeline -------------------------------------------------------------

    @property
    @abstractmethod
    def plan(self) -> Plan | None:
        """The plan run (``None`` before the first batch, unless one was given)."""

    @plan.setter
    @abstractmethod
    def plan(self, plan: Plan | None) -> None: ...

    @property
    def pipeline(self) -> Any:
        """What runs this process's stages, once built."""
        return None

    # -- a run ------------------------------------------------------------------------------------

    @abstractmethod
    def setup(self, trainer: Any) -> None:
        """The Trainer's run starts: the module, its optimizers and its devices are set."""

    @abstractmethod
    def step(self, hook: str, args: tuple, kwargs: dict, plain: Callable[..., Any]) -> Any:
        """The step ``hook`` (``"training_step"``, ...) on ``args, kwargs``; ``plain``: Lightning's."""

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, plain: Callable[..., torch.Tensor],
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        return plain(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any, plain: Callable[..., Any], **kwargs: Any) -> Any:
        return plain(optimizer, closure, model, **kwargs)

    def block_backward_sync(self) -> contextlib.AbstractContextManager[None]:
        """No reduction between replicas inside (Lightning accumulating gradients)."""
        return contextlib.nullcontext()

    def stages_placed(self) -> None:  # noqa: B027 (a runtime may need nothing then)
        """Each stage is real on its device now."""

    def failed(self, exception: BaseException) -> None:  # noqa: B027 (one process has no one to tell)
        """The run stops with ``exception`` on this rank, in the step or outside it (a callback):
        the other ranks should stop with it too, not wait."""

    @abstractmethod
    def teardown(self) -> None:
        """The run ends: let go of what the run holds; the plan stays for the next run."""


def rank_zeros_plan(make: Callable[[], Plan], host: Host, shared: bool) -> Plan:
    """Rank 0's plan on every rank: ``make`` runs on global rank 0 only, and where ``shared``
    (several processes run it) the plan goes to every other rank as data, so that every rank runs
    the same plan, whatever it would have measured itself."""
    plan = make() if host.is_global_zero else None
    if not shared:
        assert plan is not None
        return plan
    return Plan.from_dict(host.broadcast(plan.to_dict() if plan is not None else None))
