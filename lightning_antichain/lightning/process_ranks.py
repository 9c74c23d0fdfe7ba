"""The processes a strategy runs as: how they start, which rank each is, and how they talk.

A pipeline strategy's processes are either replicas of a pipeline that one process drives over
several devices, or stages (one device each): in both, a node's devices are shared out among its
processes ``devices_per_pipeline`` at a time, and the processes rank and launch as Lightning's
DDP's do, with gloo on CPU and NCCL on GPU.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override


class ProcessesStrategy(ParallelStrategy):
    """A ParallelStrategy of ``num_nodes`` nodes, each running ``num_processes`` processes of
    ``devices_per_pipeline`` devices each, started by ``start_method``."""

    start_method: str = "popen"
    _num_nodes: int = 1

    @property
    def devices_per_pipeline(self) -> int:
        raise NotImplementedError

    @property
    def is_distributed(self) -> bool:
        raise NotImplementedError

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return max(len(self.parallel_devices or []) // self.devices_per_pipeline, 1)

    @property
    def multi_process(self) -> bool:
        """More than one process: pipeline replicas, or stages as processes."""
        return self.num_nodes * self.num_processes > 1

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
        if not self.is_distributed:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

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
        """As DDPStrategy's: NCCL's barrier on this rank's own GPU (else NCCL guesses one by rank,
        which with several devices per process is another process's)."""
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]



def group_timeout(timeout: float | timedelta | None) -> timedelta:
    """``timeout`` (seconds or a ``timedelta``; ``None``: torch's default for gloo and NCCL groups,
    30 minutes) as the ``timedelta`` every process group of the strategy gets (checked with the
    strategy's other arguments, :func:`~lightning_antichain.plans.options.check_strategy_arguments`)."""
    if timeout is None:
        return dist.default_pg_timeout
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)

