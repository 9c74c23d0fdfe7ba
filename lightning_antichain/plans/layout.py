"""How the ranks of stages as processes form pipelines and their replicas: a ``(dp, pp)`` layout.

``pp`` ranks run one pipeline (one process per stage, or per ``virtual_stages`` stages); ``dp``
such pipelines train side by side on their shares of the data, and the ranks that hold the same
stage in each keep it in step (DDP or FSDP2, :mod:`~lightning_antichain.processes.replication`).
The pipeline index is the
outer one, as torchtitan's mesh orders it: a stage's replicas are neighbouring ranks, so on a node
of ``dp`` or more devices the gradients' reduction, the largest message of a step, stays within
the node, and the pipeline's cuts, which send only activations, cross the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

DIMS = ("dp", "pp")


@dataclass(frozen=True)
class Layout:
    """``dp`` replicas of a pipeline of ``pp`` ranks; rank ``p * dp + d`` is replica ``d``'s ``p``-th."""

    dp: int
    pp: int

    @classmethod
    def of(cls, world_size: int, pipeline_ranks: int | None) -> Layout:
        """The layout of ``world_size`` ranks in pipelines of ``pipeline_ranks`` (default: one
        pipeline of all); a clear error where they do not divide."""
        pp = pipeline_ranks or world_size
        if pp < 1 or world_size % pp:
            raise ValueError(
                f"pipeline_parallel_size={pp} processes per pipeline do not divide the {world_size} processes "
                f"(devices x num_nodes); give pipeline_parallel_size= a divisor of {world_size}, or leave it out "
                "for one pipeline over all of them")
        return cls(world_size // pp, pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def rank(self, replica: int, position: int) -> int:
        """The global rank of the ``position``-th rank of pipeline ``replica``."""
        return position * self.dp + replica

    def replica(self, rank: int) -> int:
        """Which pipeline ``rank`` belongs to (its index on ``"dp"``)."""
        return rank % self.dp

    def position(self, rank: int) -> int:
        """``rank``'s place in its pipeline (its index on ``"pp"``)."""
        return rank // self.dp

    def pipeline(self, replica: int) -> list[int]:
        """The global ranks of pipeline ``replica``, in pipeline order."""
        return [self.rank(replica, p) for p in range(self.pp)]

    def mesh(self, device_type: str, timeout: timedelta | None = None) -> Any:
        """The ``DeviceMesh`` with dims ``("dp", "pp")`` of this layout (every rank calls it: it
        makes the process groups of both dims), its groups waiting at most ``timeout`` (default
        torch's: gloo's transfers keep the timeout of the group they were made in)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.world_size).reshape(self.pp, self.dp).T  # [replica, position]
        if timeout is None:
            return DeviceMesh(device_type, ranks, mesh_dim_names=DIMS)
        mine: dict[str, Any] = {}
        me = dist.get_rank()
        for dim, members in (("dp", ranks.T.tolist()), ("pp", ranks.tolist())):
            for group_ranks in members:  # every rank makes every group, in one order
                group = dist.new_group(group_ranks, timeout=timeout)
                if me in group_ranks:
                    mine[dim] = group
        return DeviceMesh.from_group([mine[dim] for dim in DIMS], device_type, mesh=ranks, mesh_dim_names=DIMS)
