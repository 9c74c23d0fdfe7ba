"""Gradient averaging across pipeline replicas over torch.distributed.

Each process runs one whole pipeline (all its stages) on its share of the data; before an optimizer
step the replicas average their gradients, so every replica takes the same step, as with DDP. The
gradients are packed into flat buckets per device and dtype (fewer, larger messages). NCCL process
groups serve one device per process, so with NCCL a bucket on another of the process's GPUs travels
through the root device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 2**20


def average_gradients(parameters: Iterable[torch.nn.Parameter], root: torch.device, world_size: int) -> None:
    """Replace each parameter's gradient by its mean over all replicas (a parameter without a gradient
    on this replica counts as a zero gradient, so every replica issues the same collectives)."""
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    through_root = dist.get_backend() == "nccl"
    for bucket in _buckets(params):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        home = flat.device
        if through_root and home != root:
            flat = flat.to(root)
        dist.all_reduce(flat)
        flat.div_(world_size)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat.to(home), grads)):
            grad.copy_(reduced)


def _buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Parameters grouped by (device, dtype) in a fixed order, cut into buckets of about BUCKET_BYTES."""
    groups: dict[tuple[str, torch.dtype], list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault((str(p.device), p.dtype), []).append(p)
    buckets: list[list[torch.nn.Parameter]] = []
    for key in sorted(groups, key=lambda k: (k[0], str(k[1]))):
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in groups[key]:
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= BUCKET_BYTES:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
    return buckets
