"""Stages as ``torch.distributed.pipelining`` runs them: one process each, tensors in, tensors out.

torch's ``PipelineStage`` sends a stage's outputs to the next stage only, and takes only tensors.
The stages the split makes (:func:`~lightning_antichain.stages.split.split_stages`) already fit: each takes every value
crossing the cut before it, the ones it does not read included, and returns every value crossing
the cut after it, so a skip tensor is passed through each stage it spans. :class:`FlatStage` is
that stage as a module of tensors, for torch's schedules (GPipe, 1F1B, interleaved, zero-bubble),
which run it in the process of its rank; :func:`rank_stages` builds and places a rank's stages
alone, and :func:`schedule_runner` hands them to torch's schedule
(:class:`~.process_pipeline.ProcessPipeline` runs a batch through them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint

from ..capture import OpGraph
from ..capture.pytrees import flatten, unflatten
from ..plans.plan import Plan
from ..plans.process_schedules import ProcessSchedule
from ..stages.batchnorm import recomputing
from ..stages.block_units import outline_stage
from ..stages.split import StageModule, place_stages, split_stages
from ..weights.initialization import Initializer
from .cut_sizes import without_sizes
from .cut_values import CutLayout, CutValueError
from .replication import without_reduction_in_inference


class FlatStage(nn.Module):
    """``stage`` as a module whose arguments are the tensors crossing the cut before it, in the
    order of ``stage.inputs``, and whose outputs are those crossing the cut after it, in the order
    of ``stage.outputs`` (one tensor alone where there is one). Its parameters and buffers are the
    ones the stage uses, and only those (registered here, so torch's stage, DDP and FSDP2 see
    them): the stage's graph reaches the user's top-level modules whole (a ``blocks`` list of which
    it calls two), and a wrapper that waited for, reduced or sharded the rest would be wrong."""

    def __init__(self, stage: StageModule, recompute: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self.used = nn.ModuleList(stage.submodules())
        self.fetched = _Fetched(stage)
        self.recompute = recompute
        #: how the values crossing the cuts before and after it are sent, for the micro-batches
        #: running now (:mod:`.cut_values`); ``None``: tensors alone, as they come
        self.layouts: tuple[CutLayout, CutLayout] | None = None
        #: back-propagate whole even where the schedule splits input and weight gradients: its
        #: weights are not all reached from its inputs (:func:`~.cut_values.cut_layouts`)
        self.whole_backward = False

    def forward(self, *sent: torch.Tensor) -> Any:
        sent = tuple(_Received.apply(v) if isinstance(v, torch.Tensor) and v.requires_grad else v for v in sent)
        values = sent if self.layouts is None else self.layouts[0].unpack(sent)
        if len(values) != len(self.stage.inputs):
            raise CutValueError(f"stage {self.stage.index} takes {len(self.stage.inputs)} values "
                                f"({', '.join(self.stage.inputs)}), got {len(values)}")
        if self.recompute and torch.is_grad_enabled():  # keep the inputs only; run the forward again in backward
            leaves = list(checkpoint(self._leaves, *values, use_reentrant=False, context_fn=self._contexts))
        else:
            leaves = self._leaves(*values)
        outputs = unflatten(leaves, self._output_spec)
        if self.layouts is not None:
            leaves = list(self.layouts[1].pack(tuple(outputs), self.stage.device, f"stage {self.stage.index}"))
        elif len(leaves) != len(self.stage.outputs) or not all(isinstance(v, torch.Tensor) for v in leaves):
            raise CutValueError(
                f"stage {self.stage.index} passes on values that are not single tensors, and the shapes crossing "
                "its cuts could not be found on fake tensors before the first step (see the warning), so they "
                "cannot be carried. Cut elsewhere (a fixed balance=), or keep the operation that makes them with its "
                "readers.")
        leaves = [_Sent.apply(v) for v in leaves]
        return leaves[0] if len(leaves) == 1 else tuple(leaves)

    def _leaves(self, *values: Any) -> list[Any]:
        leaves, self._output_spec = self.stage(*flatten(tuple(values)))
        return leaves

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The forward as is; its recomputation without a second update of BatchNorm statistics."""
        return contextlib.nullcontext(), recomputing(self.stage.submodules(), self.stage.buffers())


class _Fetched(nn.Module):
    """The parameters and buffers a stage's graph reads directly (not through a module it calls),
    registered under numbered names: the same tensor objects the user's module holds."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        called = {id(t) for m in stage.submodules() for t in [*m.parameters(), *m.buffers()]}
        params = [p for p in stage.parameters() if id(p) not in called]
        for i, param in enumerate(params):
            self.register_parameter(f"p{i}", param)
        for i, buffer in enumerate(b for b in stage.buffers() if id(b) not in called):
            self.register_buffer(f"b{i}", buffer)


class _Sent(torch.autograd.Function):
    """A value a stage sends on, as a tensor object of its own over the same memory. torch's
    zero-bubble schedules detach a stage's outputs in place once their input gradients are taken;
    that must not reach the tensor itself where its own operations saved it for the weight
    gradients still to come (a Linear's input, a tanh's output), nor an input passed through. It is
    contiguous: torch.distributed sends tensors as they lie in memory."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.detach() if value.is_contiguous() else value.contiguous()  # sent as it lies in memory

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def split_for_ranks(graph: OpGraph, plan: Plan, schedule: ProcessSchedule, ranks: int,
                    device: torch.device) -> list[StageModule]:
    """Every stage of ``plan`` for ``ranks`` ranks under ``schedule``, split from ``graph``, none placed,
    each reading the sizes it needs from the tensors it receives (:mod:`.cut_sizes`)."""
    if plan.num_stages != schedule.num_stages(ranks):
        raise ValueError(f"schedule {schedule.name!r} with {schedule.virtual_stages} stage(s) per rank on {ranks} "
                         f"ranks runs {schedule.num_stages(ranks)} stages; the plan has {plan.num_stages}. Plan for "
                         f"{schedule.num_stages(ranks)} stages.")
    return without_sizes(split_stages(graph, plan, [device] * plan.num_stages), graph)


def place_rank(stages: list[StageModule], schedule: ProcessSchedule, rank: int, ranks: int,
               initializer: Initializer | None = None, recompute: bool = False,
               blocks_of: OpGraph | None = None) -> list[FlatStage]:
    """Rank ``rank``'s stages among ``stages``, placed (made real, where the model is on meta) on
    their device: these stages alone; with ``recompute``, each keeping only its inputs for backward;
    with ``blocks_of``, each with its operations grouped by the blocks of that graph that issued
    them (:mod:`~lightning_antichain.stages.block_units`), for FSDP2 to shard block by block."""
    mine = [stages[i] for i in schedule.stages_of(rank, ranks)]
    place_stages(mine, initializer)
    for stage in mine if blocks_of is not None else ():
        outline_stage(stage, blocks_of)
    return [FlatStage(stage, recompute) for stage in mine]


def holders(stages: list[StageModule], schedule: ProcessSchedule, ranks: int) -> dict[int, tuple[int, ...]]:
    """The ranks whose stages use each parameter, by the parameter's id."""
    found: dict[int, set[int]] = {}
    for stage in stages:
        rank = schedule.rank_of(stage.index, ranks)
        for param in stage.parameters():
            found.setdefault(id(param), set()).add(rank)
    return {key: tuple(sorted(ranks_)) for key, ranks_ in found.items()}


class _Received(torch.autograd.Function):
    """A value a stage receives, whose gradient goes back contiguous: torch.distributed sends
    tensors as they lie in memory, and the gradient of a view or an expand does not lie in one piece."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def rank_flat_stages(graph: OpGraph, plan: Plan, schedule: ProcessSchedule, rank: int, ranks: int,
                     device: torch.device, initializer: Initializer | None = None) -> list[FlatStage]:
    """The stages rank ``rank`` of ``ranks`` holds under ``schedule``, split from ``graph`` as ``plan``
    cuts it and placed on ``device``. A parameter that stages of two ranks use is refused here:
    :class:`~.process_pipeline.ProcessPipeline` keeps such copies in step."""
    stages = split_for_ranks(graph, plan, schedule, ranks, device)
    shared = [ranks_ for ranks_ in holders(stages, schedule, ranks).values() if len(ranks_) > 1]
    if shared:
        raise ValueError(f"a parameter is used by stages on ranks {shared[0]} (tied weights): run the stages with "
                         "ProcessPipeline, which keeps its copies in step")
    return place_rank(stages, schedule, rank, ranks, initializer)


def torch_stages(flat: list[FlatStage], num_stages: int, device: torch.device, group: Any = None,
                 modules: list[nn.Module] | None = None) -> list[PipelineStage]:
    """``flat`` as torch's stages, given what crosses their cuts where each stage's ``layouts``
    say (else they learn it on their first step); ``modules``: what runs each (``flat`` itself,
    or its replicated wrapper: :mod:`.replication`)."""
    stages = [PipelineStage(module, stage.stage.index, num_stages, device, group=group,
                            **({} if stage.layouts is None else {"input_args": stage.layouts[0].sent,
                                                                 "output_args": stage.layouts[1].sent}),
                            **({"dw_builder": _no_weight_pass} if stage.whole_backward else {}))
              for stage, module in zip(flat, modules or flat)]
    for stage in stages:
        without_reduction_in_inference(stage)
    return stages


def _no_weight_pass() -> Callable[[], None]:
    """torch's deferred weight pass of a stage back-propagated whole in its input pass (torch takes
    a ``dw_builder`` to mean that): nothing left to do."""
    return lambda: None


def rank_stages(graph: OpGraph, plan: Plan, schedule: ProcessSchedule, rank: int, ranks: int,
                device: torch.device, group: Any = None) -> list[PipelineStage]:
    """:func:`rank_flat_stages` as torch's stages."""
    flat = rank_flat_stages(graph, plan, schedule, rank, ranks, device)
    return torch_stages(flat, plan.num_stages, device, group)


def schedule_runner(schedule: ProcessSchedule, stages: list[PipelineStage], chunks: int,
                    loss_fn: Callable[..., torch.Tensor] | None) -> Any:
    """torch's schedule that runs ``stages`` (this rank's) over ``chunks`` micro-batches, back-propagating
    the sum of ``loss_fn`` over them (``scale_grads=False``: the caller's loss decides the scale)."""
    held = stages if schedule.takes_a_list else stages[0]
    return schedule.runs_with(held, chunks, loss_fn=loss_fn, scale_grads=False)
