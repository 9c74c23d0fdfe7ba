"""Every stage's process must see the same batch, step after step.

With one process per stage, the first stage's rank computes the module's inputs from its batch and
the last stage's rank computes the loss from its own: were they different batches, training would
go on, wrong, and nothing would say so. A DataLoader that shuffles draws its order in each process
on its own, so its ``RandomSampler`` draws from rank 0's generator on every rank, the order plain
Lightning would draw there (:func:`same_order_everywhere`); and every step checks that the ranks
hold one batch (:func:`check_same_batch`), with one small collective, so a loader that still
differs stops training with a clear error on every rank at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, RandomSampler

from ..capture.pytrees import flatten


class RankZeroOrder(RandomSampler):
    """A ``RandomSampler`` that draws each epoch's order from rank 0's random state on every rank:
    the order plain Lightning draws (a ``RandomSampler`` without a generator seeds one from torch's
    global generator each epoch), the same in every process."""

    def __iter__(self) -> Iterator[int]:
        seed = [int(torch.empty((), dtype=torch.int64).random_().item())]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(seed, src=0)
        generator = torch.Generator()
        generator.manual_seed(seed[0])
        self.generator = generator
        try:
            yield from super().__iter__()
        finally:
            self.generator = None


def same_order_everywhere(dataloader: object) -> object:
    """``dataloader``, with a sampler that draws one order in every process where it shuffles."""
    if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not RandomSampler:
        return dataloader
    sampler = dataloader.sampler
    if sampler.generator is not None:
        return dataloader  # seeded by the user: the same in every process that seeds it alike (checked per step)
    return _update_dataloader(dataloader, RankZeroOrder(sampler.data_source, sampler.replacement,
                                                        sampler._num_samples))


def check_same_batch(batch: Any, device: torch.device, group: Any = None, called: int | None = None) -> int | None:
    """Raise on every rank, together, if the ranks do not hold the same ``batch``. ``called``: on a
    rank that holds the first stage, how many of the batch's micro-batches the step called the
    module on (``None`` elsewhere); every rank gets it back, so that all skip a batch the step
    skips (``None`` where no rank knows). Ranks that know and disagree (replicas whose steps
    skipped differently) raise, together."""
    leaves, _ = flatten(batch)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    shapes = float(sum(hash(tuple(t.shape)) % 1_000_003 for t in tensors))
    values = sum((t.detach().double().sum() for t in tensors if t.numel()), torch.zeros((), dtype=torch.float64,
                                                                                          device=device))
    unknown = -float("inf")
    counts = [unknown, unknown] if called is None else [float(called), -float(called)]
    probe = torch.stack([torch.nan_to_num(values).to(device), torch.tensor(shapes, dtype=torch.float64, device=device)])
    both = torch.cat([probe, -probe, torch.tensor(counts, dtype=torch.float64, device=device)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[:2], -both[2:4]):
        raise RuntimeError(
            "the stages' processes got different batches in this step. With schedule=, every process must get the same "
            "batches in the same order: use a DataLoader without shuffle, or a sampler that draws the same order in "
            "every process (a torch.Generator seeded alike, or lightning.seed_everything before the Trainer)."
        )
    most, least = float(both[4]), -float(both[5])
    if most == unknown:
        return None
    if most != least:
        raise RuntimeError(
            f"the step called the pipelined module on {int(least)} of this batch's micro-batches in one pipeline "
            f"replica and on {int(most)} in another; with replicas, a step must skip a batch (return None before "
            "calling the module) in all of them or in none")
    return int(most)
