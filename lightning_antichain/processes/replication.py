"""A stage replicated over the data-parallel ranks of a mesh, by torch.

Where ``dp`` pipelines train side by side, the ranks that hold the same stage form a group (the
mesh's ``"dp"`` dimension), and torch keeps their copies of the stage in step: DDP all-reduces the
gradients, or FSDP2 (``fully_shard``) shards the parameters, gradients and optimizer state over
them and gathers the parameters for each forward and backward. torch's pipeline stage knows both
wrappers (``PipelineStage.backward_maybe_with_nosync``): the gradients are reduced during the last
micro-batch's backward, not after the step.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from torch import nn

Replication = Literal["ddp", "fsdp"]
REPLICATIONS: tuple[Replication, ...] = ("ddp", "fsdp")


def replicated(stage: nn.Module, how: Replication, mesh: Any) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """``stage`` kept in step over the ranks of ``mesh`` (a 1-D ``DeviceMesh``: the ranks that hold
    this stage in the other replicas): wrapped in DDP, or sharded in place by FSDP2; and the
    parameters FSDP2 replaced (the user's modules then hold a ``DTensor`` shard of each), by the
    id of the parameter each replaced."""
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(stage, process_group=mesh.get_group()), {}
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        before = dict(stage.named_parameters())
        sharded = fully_shard(stage, mesh=mesh)
        return sharded, {id(before[name]): param for name, param in stage.named_parameters()
                         if param is not before[name]}
    raise ValueError(f"replication={how!r} is not one of {', '.join(REPLICATIONS)}")


def full(value: Any) -> Any:
    """``value`` whole where it is a ``DTensor`` shard (every rank of its mesh calls it, in the same
    order), else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def is_shard(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor``: a share of a tensor spread over replicas (FSDP2's)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local(value: Any) -> Any:
    """This rank's part of ``value`` where it is a ``DTensor``, else ``value``."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def without_reduction_in_inference(stage: Any) -> None:
    """Keep torch's shape inference from leaving a DDP-wrapped ``stage`` (a ``PipelineStage``)
    waiting for a reduction: its made-up forward runs with gradients on, and DDP's forward then
    expects the parameters' gradients, which the inference's backward (to the inputs only) never
    gives, so the first real forward would fail. That forward runs under ``no_sync`` instead."""
    module = stage.submod
    if not isinstance(module, nn.parallel.DistributedDataParallel):
        return
    infer = stage._forward_metadata_inference

    @functools.wraps(infer)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with module.no_sync():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = quiet
