"""Every stage's process must see the same batch, step after step.

With one process per stage, the first stage's rank computes the module's inputs from its batch and
the last stage's rank computes the loss from its own: were they different batches, training would
go on, wrong, and nothing would say so. A DataLoader that shuffles draws its order in each process
on its own, so its ``RandomSampler`` draws from rank 0's generator on every rank, the order plain
Lightning would draw there (:func:`same_order_everywhere`); and every step checks that the ranks of
a pipeline hold one batch (:func:`agree_on_step`), with one small collective, so a loader that
still differs stops training with a clear error on every rank at once. That collective also tells
every rank what only some know: whether the step skips the batch, and each replica's share.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class StepAgreement:
    """What every rank knows of a step after :func:`agree_on_step`."""

    #: the share of the step's micro-batches the step called the module on (``None``: no rank knows)
    called: float | None
    #: the samples of each replica's share of the batch, by replica
    samples: tuple[int, ...]
    #: the label tokens each replica's share counts (:mod:`~lightning_antichain.batches.model_loss`),
    #: ``None`` where not counted
    items: tuple[float, ...] | None


def agree_on_step(batch: Any, device: torch.device, replicas: int = 1, replica: int = 0, samples: int = 0,
                  called: float | None = None, items: float | None = None) -> StepAgreement:
    """One small collective over every rank before a step. It raises on every rank, together, if
    the ranks of a pipeline replica do not hold the same ``batch`` (replica ``replica`` of
    ``replicas``, whose share of the step holds ``samples`` samples); and it gives every rank what
    the ranks holding a first stage found: ``called``, the share of the micro-batches the step
    called the module on (so that all refuse a batch the step skips), and ``items``, the label
    tokens their share counts. Replicas whose steps skipped differently raise, together."""
    leaves, _ = flatten(batch)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    shapes = float(sum(hash(tuple(t.shape)) % 1_000_003 for t in tensors))
    values = sum((_sampled(t).sum() for t in tensors if t.numel()), torch.zeros((), dtype=torch.float64,
                                                                                 device=device))
    unknown = -float("inf")
    slots = torch.full((replicas, 6), unknown, dtype=torch.float64, device=device)
    content = torch.stack([torch.nan_to_num(values).to(device), torch.tensor(shapes, dtype=torch.float64,
                                                                             device=device)])
    slots[replica, :4] = torch.cat([content, -content])
    slots[replica, 4] = float(samples)
    if items is not None:
        slots[replica, 5] = float(items)
    counts = [unknown, unknown] if called is None else [float(called), -float(called)]
    both = torch.cat([slots.flatten(), torch.tensor(counts, dtype=torch.float64, device=device)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    slots = both[:-2].view(replicas, 6).cpu()
    if not torch.equal(slots[:, :2], -slots[:, 2:4]):
        raise RuntimeError(
            "the stages' processes got different batches in this step. With schedule=, every process of a pipeline "
            "must get the same batches in the same order: use a DataLoader without shuffle, or a sampler that draws "
            "the same order in every process (a torch.Generator seeded alike, or lightning.seed_everything before the "
            "Trainer)."
        )
    most, least = float(both[-2]), -float(both[-1])
    if most != least:
        raise RuntimeError(
            f"the step called the pipelined module on {least:.0%} of this batch's micro-batches in one pipeline "
            f"replica and on {most:.0%} in another; with replicas, a step must skip a batch (return None before "
            "calling the module) in all of them or in none")
    found = slots[:, 5].tolist()
    return StepAgreement(None if most == unknown else most, tuple(int(n) for n in slots[:, 4].tolist()),
                         None if any(n == unknown for n in found) else tuple(found))


def _sampled(tensor: torch.Tensor, count: int = 4096) -> torch.Tensor:
    """Up to ``count`` of ``tensor``'s values, evenly spaced, in float64: what tells two batches
    apart (a sum over all of an image batch's values would cost more than the check is worth)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // count)
    return flat[::step][:count].double()
