"""A stage replicated over the data-parallel ranks of a mesh, by torch.

Where ``dp`` pipelines train side by side, the ranks that hold the same stage form a group (the
mesh's ``"dp"`` dimension), and torch keeps their copies of the stage in step: DDP all-reduces the
gradients, or FSDP2 (``fully_shard``) shards the parameters, gradients and optimizer state over
them and gathers the parameters for each forward and backward. torch's pipeline stage knows both
wrappers (``PipelineStage.backward_maybe_with_nosync``): the gradients are reduced during the last
micro-batch's backward, not after the step.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

Replication = Literal["ddp", "fsdp"]
REPLICATIONS: tuple[Replication, ...] = ("ddp", "fsdp")


def replicated(stage: nn.Module, how: Replication, mesh: Any) -> nn.Module:
    """``stage`` kept in step over the ranks of ``mesh`` (a 1-D ``DeviceMesh``: the ranks that hold
    this stage in the other replicas): wrapped in DDP, or sharded in place by FSDP2."""
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(stage, process_group=mesh.get_group())
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(stage, mesh=mesh)
    raise ValueError(f"replication={how!r} is not one of {', '.join(REPLICATIONS)}")
