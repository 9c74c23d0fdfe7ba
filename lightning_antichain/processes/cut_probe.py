"""What crosses each cut, from one real forward through the ranks, where fake tensors cannot tell.

A graph that reads values (``.item()``, which a concrete capture keeps where ``nn.Transformer``
checks whether its mask is causal; ``nonzero``) cannot run on fake tensors
(:func:`~.cut_values.cut_layouts`). Then the first micro-batch of a new shape runs once, for real,
through every stage in pipeline order, each rank running its own stages and sending what a stage
passes on to the rank of the next (torch.distributed's object send, values on the CPU). Buffers
the forward updates (BatchNorm's running statistics) and the random generators it draws from are
put back afterwards: the probe changes nothing training computes. Under a schedule that takes
input and weight gradients apart, every stage but the first then back-propagates whole: trying
torch's split on real weights would touch their gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..capture.isolation import side_effects_undone
from ..capture.pytrees import flatten, unflatten
from ..plans.process_schedules import ProcessSchedule
from ..stages.split import StageModule
from .cut_values import CutLayout, CutLayouts, layout_of, registered


def probed_layouts(stages: Sequence[StageModule], schedule: ProcessSchedule, rank: int, ranks: int,
                   inputs: tuple | None, device: torch.device, train: bool, group: Any = None,
                   splits_backward: bool = False) -> CutLayouts:
    """:class:`~.cut_values.CutLayouts` of every cut of ``stages`` (all of a plan's) from one real
    forward of a micro-batch, the first stage taking ``inputs`` (given on its rank): rank
    ``rank`` of ``ranks`` runs its own stages. Every rank of the pipeline calls it; every rank
    gets every cut's layout."""
    found: dict[int, CutLayout] = {}
    whole: set[int] = set()
    values: tuple | None = inputs
    for index, stage in enumerate(stages):
        if schedule.rank_of(index, ranks) != rank:
            continue
        if index == 0:
            assert values is not None, "the rank of the first stage gives the first micro-batch's values"
        elif schedule.rank_of(index - 1, ranks) != rank:
            values = _received(schedule.rank_of(index - 1, ranks), device, group)
        assert values is not None
        found[index] = layout_of(values)
        with torch.set_grad_enabled(train), side_effects_undone(stage.module):
            outputs = tuple(stage.hookless_module(*stage.arguments(values)))
        if splits_backward and train and index > 0:  # no trial of torch's split backward on real weights here
            whole.add(index)
        if index == len(stages) - 1:
            found[index + 1] = layout_of(outputs)
        elif schedule.rank_of(index + 1, ranks) != rank:
            _send(outputs, schedule.rank_of(index + 1, ranks), group)
        values = outputs
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (found, whole), group=group)
    cuts: dict[int, CutLayout] = {}
    for part, missed in everyone:
        cuts.update(part)
        whole |= missed
    return CutLayouts(tuple(cuts[k] for k in range(len(stages) + 1)), frozenset(whole))


def _send(values: tuple, to: int, group: Any) -> None:
    """``values`` on the CPU, detached, with which tensors need a gradient, to rank ``to`` of ``group``."""
    leaves, spec = flatten(values)
    sent = ([v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in leaves], spec,
            [isinstance(v, torch.Tensor) and v.requires_grad for v in leaves])
    dist.send_object_list([sent], dst=_global(to, group), group=group)


def _received(source: int, device: torch.device, group: Any) -> tuple:
    """What :func:`_send` sent from rank ``source``: its tensors on ``device``, needing a gradient as they did."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=_global(source, group), group=group)
    leaves, spec, needs = box[0]
    registered(CutLayouts((CutLayout(spec, (), ()),)))  # dataclasses it nests, known here too
    leaves = [v.to(device).requires_grad_(grad and v.is_floating_point()) if isinstance(v, torch.Tensor) else v
              for v, grad in zip(leaves, needs)]
    return tuple(unflatten(leaves, spec))


def _global(rank: int, group: Any) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
