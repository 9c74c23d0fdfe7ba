"""Clipping by the norm of every stage's gradients, where each process holds some of them.

Lightning clips the parameters its optimizer holds; with one process per stage, each process's
gradients are its stages' only, and clipping them by their own norm would scale each stage by
another factor than plain training does. Each process's norm comes from torch
(``torch.nn.utils.get_total_norm``; a sharded gradient, FSDP2's ``DTensor``, counts its own
shard), and their squares are summed over the processes, as torchtitan clips over a pipeline.
Lightning reaches it through the precision plugin's own hook, ``clip_grad_by_norm``: the run's
plugin is a copy of the user's of a subclass that overrides it (:func:`clipping_over_ranks`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .replication import local


def clip_by_global_norm(params: Iterable[torch.Tensor], max_norm: float, device: torch.device,
                        counted_elsewhere: frozenset[int] | set[int] = frozenset(), group: object = None
                        ) -> torch.Tensor:
    """Scale the gradients of ``params`` (this process's) so that the norm of every process's
    gradients together is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for
    one process; that norm. A parameter whose id is in ``counted_elsewhere`` (a tied copy another
    process counts) is scaled but not counted here."""
    params = [p for p in params if p.grad is not None]
    grads = [local(p.grad).detach() for p in params]
    counted = [g for p, g in zip(params, grads) if id(p) not in counted_elsewhere]
    own = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros(())
    squares = own.to(device=device, dtype=torch.float64).square()
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(scale.to(device=grad.device, dtype=grad.dtype))
    return norm


class _ClippingOverRanks:
    """Mixed before a precision plugin's class: clipping by norm takes every rank's gradients."""

    _clip_over_ranks: Callable[[Any, float], object]

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._clip_over_ranks(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]


def clipping_over_ranks(plugin: Any, clip: Callable[[Any, float], object]) -> Any:
    """A copy of the precision ``plugin`` whose clipping by norm is ``clip(params, max_norm)``,
    everything else its own; the plugin given is left as it was."""
    kind = type(plugin)
    run = copy.copy(plugin)
    run.__class__ = type(f"{kind.__name__}OverRanks", (_ClippingOverRanks, kind), {"__module__": __name__})
    run._clip_over_ranks = clip
    return run
