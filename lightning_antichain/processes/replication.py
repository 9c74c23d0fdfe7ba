"""A stage replicated over the data-parallel ranks of a mesh, by torch.

Where ``dp`` pipelines train side by side, the ranks that hold the same stage form a group (the
mesh's ``"dp"`` dimension), and torch keeps their copies of the stage in step: DDP all-reduces the
gradients, or FSDP2 (``fully_shard``) shards the parameters, gradients and optimizer state over
them and gathers the parameters for each forward and backward. torch's pipeline stage knows both
wrappers (``PipelineStage.backward_maybe_with_nosync``): the gradients are reduced during the last
micro-batch's backward, not after the step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from torch import nn

from ..plans.options import REPLICATIONS
from ..torch_private import wrap_shape_inference

Replication = Literal["ddp", "fsdp"]
Regather = Literal["micro_batch", "step"]
"""How often FSDP2 gathers a block's parameters: for each micro-batch's forward and again for its
backward, its gradients reduce-scattered in each backward (the least memory: a block or two
gathered at a time); or once per step, kept gathered and its gradients reduced once, after the
last micro-batch (the fewest collectives: the whole stage and its gradients gathered)."""
REGATHERS: tuple[Regather, ...] = ("micro_batch", "step")


def replicated(stage: nn.Module, how: Replication, mesh: Any, blocks: Sequence[nn.Module] = (),
               regather: Regather = "step") -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """``stage`` kept in step over the ranks of ``mesh`` (a 1-D ``DeviceMesh``: the ranks that hold
    this stage in the other replicas): wrapped in DDP, or sharded in place by FSDP2; and the
    parameters FSDP2 replaced (the user's modules then hold a ``DTensor`` shard of each), by the
    id of the parameter each replaced.

    FSDP2 shards each of ``blocks`` (modules the stage calls, in the order it calls them) as a unit
    of its own, gathered for its forward with the next one prefetched, and for its backward with
    the one before it prefetched, its gradients reduce-scattered as its backward ends; then the
    stage, for the parameters outside them. ``regather``: how often (:data:`Regather`)."""
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(stage, process_group=mesh.get_group()), {}
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        before = dict(stage.named_parameters())
        if regather not in REGATHERS:
            raise ValueError(f"regather={regather!r} is not one of {', '.join(REGATHERS)}")
        units = [fully_shard(block, mesh=mesh, reshard_after_forward=regather == "micro_batch") for block in blocks]
        for unit, after in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([after])
        sharded = fully_shard(stage, mesh=mesh)
        replaced = {id(before[name]): param for name, param in stage.named_parameters() if param is not before[name]}
        return (sharded if regather == "step" else EveryMicroBatch(sharded)), replaced
    raise ValueError(f"replication={how!r} is not one of {', '.join(REPLICATIONS)}")


class EveryMicroBatch(nn.Module):
    """A stage FSDP2 sharded, which torch's pipeline stage takes for a plain module: FSDP2's own
    hooks then free each block's gathered parameters after its backward and reduce-scatter its
    gradients there, in every micro-batch. Given the sharded module itself, torch's stage keeps
    everything gathered and the gradients whole until the last micro-batch (``Regather`` "step")."""

    def __init__(self, sharded: nn.Module) -> None:
        super().__init__()
        self.sharded = sharded

    def forward(self, *args: Any) -> Any:
        return self.sharded(*args)


@contextlib.contextmanager
def gathered(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside this block, the parameters FSDP2 sharded in ``modules`` are whole: for running a
    stage outside the hooks that gather them (to find what crosses its cuts). Every replica of the
    stages calls it, as FSDP2's gathers are collectives."""
    sharded = sharded_modules(modules)
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()


def resharded(modules: Sequence[nn.Module]) -> None:
    """Free what FSDP2 keeps gathered after a forward without backward (an evaluation): the stage
    that holds the rest keeps its parameters gathered after its forward, for the backward that
    would come; until resharded, the modules hold those whole tensors in place of the shards that
    the optimizer steps."""
    for module in sharded_modules(modules):
        module.reshard()


def sharded_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules FSDP2 sharded in ``modules``' trees, each once, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return list({id(m): m for module in modules for m in module.modules() if isinstance(m, FSDPModule)}.values())


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

    def quietly(infer: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(infer)
        def quiet(*args: Any, **kwargs: Any) -> Any:
            with module.no_sync():
                return infer(*args, **kwargs)

        return quiet

    wrap_shape_inference(stage, quietly)
