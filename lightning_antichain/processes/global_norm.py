"""Clipping by the norm of every stage's gradients, where each process holds some of them.

Lightning clips the parameters its optimizer holds; with one process per stage, each process's
gradients are its stages' only, and clipping them by their own norm would scale each stage by
another factor than plain training does. The squared norms are summed over the processes first
(a sharded gradient, FSDP2's ``DTensor``, counts its own shard).
"""

from __future__ import annotations

from collections.abc import Iterable

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
    grads = [local(p.grad) for p in params]
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for param, grad in zip(params, grads):
        if id(param) not in counted_elsewhere:
            squares += grad.detach().double().square().sum().to(device)
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(scale.to(device=grad.device, dtype=grad.dtype))
    return norm
