"""Replicas of an in-process pipeline kept in step by torch's DDP, one per stage.

Where several processes each run a whole pipeline (its stages in threads) on their share of the
data, each stage's parameters are wrapped in a ``DistributedDataParallel`` over the replicas. Its
reducer is armed just before the stage's last micro-batch's backward: the gradients accumulated
over the earlier micro-batches then go out bucket by bucket while that backward still runs, and
the stage's gradients are averaged when it returns, as torch's pipeline stages do with DDP
(``PipelineStage.backward_maybe_with_nosync``). Each stage has a process group of its own: the
stages' backwards run in their own threads, and collectives on one group must be issued in the
same order on every rank.

A parameter read on several devices (a tied weight;
:mod:`~lightning_antichain.stages.tied_copies`) gets its gradient summed
from copies outside autograd, so no DDP hook sees it; a parameter that no stage uses (a loss
module's) gets its gradient outside the pipeline. Those are averaged after the backward
(:func:`average_gradients`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _Parameters(nn.Module):
    """A stage's parameters as a module, for DDP (the user's modules stay as they are)."""

    def __init__(self, parameters: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.held = nn.ParameterList(parameters)


class StageReduction:
    """DDP per stage for the replicas of an in-process pipeline (see the module's docstring).

    ``stage_parameters[k]``: the parameters stage ``k`` trains (tied ones left out); ``groups[k]``:
    its process group over the replicas. Making it is collective: every replica makes it at the same
    point, with the same plan. It may be made between a forward and its backward, so DDP does not
    copy the first replica's values into the others (``init_sync=False``): replicas start equal as
    they are made (the same seed), as they had to when they averaged their gradients by hand."""

    def __init__(self, stage_parameters: Sequence[Sequence[nn.Parameter]], groups: Sequence[Any]) -> None:
        self.synchronizing = True
        self._ddp: list[nn.parallel.DistributedDataParallel | None] = []
        #: the ids of the parameters some stage's DDP averages
        self.held: set[int] = set()
        for parameters, group in zip(stage_parameters, groups, strict=True):
            trained = [p for p in parameters if p.requires_grad]
            self.held |= {id(p) for p in trained}
            # find_unused_parameters: a parameter that gets no gradient in a step (an output the loss
            # does not use) counts as zero instead of leaving its bucket waiting; torch warns once that
            # it found none where every output is used
            self._ddp.append(None if not trained else nn.parallel.DistributedDataParallel(
                _Parameters(trained), process_group=group, find_unused_parameters=True, init_sync=False))

    @property
    def stages(self) -> int:
        return len(self._ddp)

    def before_last_backward(self, stage: int, outputs: Sequence[torch.Tensor]) -> None:
        """Arm stage ``stage``'s reduction for the backward from ``outputs`` (its last micro-batch's,
        and their gradients) that follows."""
        ddp = self._ddp[stage]
        if ddp is not None and self.synchronizing:
            ddp.reducer.prepare_for_backward(list(outputs))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No reduction inside the block (accumulating gradients over batches), as DDP's ``no_sync``."""
        before, self.synchronizing = self.synchronizing, False
        try:
            yield
        finally:
            self.synchronizing = before


def average_gradients(parameters: Iterable[nn.Parameter], root: torch.device, group: Any = None) -> None:
    """Average the gradients of ``parameters`` over ``group``, one all-reduce each, in the given
    order on every rank (a parameter without a gradient counts as zero): for those no stage's DDP
    holds. NCCL groups serve one GPU per process, so there a gradient on another GPU goes through
    ``root``."""
    size = dist.get_world_size(group)
    through_root = dist.get_backend(group) == "nccl"
    for p in parameters:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad.to(root) if through_root and p.grad.device != root else p.grad
        dist.all_reduce(grad, group=group)
        grad.div_(size)
        if grad is not p.grad:
            p.grad.copy_(grad)
