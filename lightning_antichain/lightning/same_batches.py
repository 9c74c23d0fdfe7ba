"""Every stage's process must see the same batch, step after step.

With one process per stage, the first stage's rank computes the module's inputs from its batch and
the last stage's rank computes the loss from its own: were they different batches, training would
go on, wrong, and nothing would say so. A DataLoader that shuffles draws its order in each process
on its own, so it is given a sampler that shuffles alike in every process, reshuffling each epoch
as Lightning's distributed sampler does (:func:`same_order_everywhere`); and every step checks that
the ranks hold one batch (:func:`check_same_batch`), with one small collective, so a loader that
still differs stops training with a clear error on every rank at once.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from ..capture.pytrees import flatten


def same_order_everywhere(dataloader: object) -> object:
    """``dataloader``, with a sampler that draws one order in every process where it shuffles."""
    if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.sampler, RandomSampler):
        return dataloader
    if dataloader.sampler.replacement or dataloader.sampler._num_samples is not None:
        return dataloader  # left as it is; check_same_batch catches a difference
    sampler = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True,
                                 seed=int(os.getenv("PL_GLOBAL_SEED", 0)))
    return _update_dataloader(dataloader, sampler)


def check_same_batch(batch: Any, device: torch.device, group: Any = None) -> None:
    """Raise on every rank, together, if the ranks do not hold the same ``batch``."""
    leaves, _ = flatten(batch)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    shapes = float(sum(hash(tuple(t.shape)) % 1_000_003 for t in tensors))
    values = sum((t.detach().double().sum() for t in tensors if t.numel()), torch.zeros((), dtype=torch.float64,
                                                                                          device=device))
    probe = torch.stack([torch.nan_to_num(values).to(device), torch.tensor(shapes, dtype=torch.float64, device=device)])
    both = torch.cat([probe, -probe])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[:2], -both[2:]):
        raise RuntimeError(
            "the stages' processes got different batches in this step. With schedule=, every process must get the same "
            "batches in the same order: use a DataLoader without shuffle, or a sampler that draws the same order in "
            "every process (a torch.Generator seeded alike, or lightning.seed_everything before the Trainer)."
        )
