"""Each pipeline replica loads only its share of the step's batch.

With replicas of a pipeline of processes (``schedule=`` and ``pipeline_parallel_size=`` fewer than the ranks), a
step trains on the batch the DataLoader gives plain Lightning (its ``batch_size``), and replica
``r`` of ``dp`` on its ``r``-th share. Each replica's processes load that share only: the loader's
batches, drawn in the order its sampler gives (rank 0's draw where it shuffles,
:mod:`.same_batches`), are cut into ``dp`` shares whose sizes differ by one sample at most
(``torch.tensor_split``), and this replica's batch sampler yields its own (:class:`ReplicaBatches`).
So data loading does not grow with the replicas, and a layout never changes what a step trains on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import BatchSampler, DataLoader, Sampler


class ReplicaBatches(Sampler[list[int]]):
    """The batches of ``batch_size`` samples (the last shorter unless ``drop_last``) that ``sampler``
    draws, each cut into ``replicas`` shares: replica ``replica``'s."""

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool, replicas: int, replica: int) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.replicas, self.replica = replicas, replica

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield self._share(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._share(batch)

    def __len__(self) -> int:
        count = len(self.sampler)  # type: ignore[arg-type]
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)

    def _share(self, batch: list[int]) -> list[int]:
        if len(batch) < self.replicas:
            raise ValueError(
                f"a batch of {len(batch)} samples (the last of the epoch) cannot be shared by {self.replicas} pipeline "
                f"replicas, one sample each at least: set drop_last=True in the DataLoader, or give it a batch_size "
                f"and a data set whose last batch holds {self.replicas} samples or more")
        sizes = [len(part) for part in torch.tensor_split(torch.arange(len(batch)), self.replicas)]
        start = sum(sizes[: self.replica])
        return batch[start : start + sizes[self.replica]]


def replica_loader(dataloader: Any, replicas: int, replica: int) -> DataLoader:
    """``dataloader`` loading replica ``replica``'s share of each of its batches (see the module's
    docstring); a clear error where its batches are not made by torch's ``BatchSampler``."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"with {replicas} pipeline replicas, each loads its share of every batch, which takes a "
                        f"torch DataLoader; got {type(dataloader).__name__}. Wrap the data in a DataLoader.")
    batches = dataloader.batch_sampler
    indexed = isinstance(batches, _IndexBatchSamplerWrapper)  # Lightning's, around a predict loader's batches
    inner = batches._batch_sampler if indexed else batches
    if type(inner) is not BatchSampler:
        raise TypeError(f"with {replicas} pipeline replicas, each loads its share of every batch, which takes torch's "
                        f"BatchSampler (a batch_size); this DataLoader's batches come from {type(inner).__name__}. "
                        "Give the DataLoader a batch_size (and a sampler), or train without replicas.")
    shares: Sampler[list[int]] = ReplicaBatches(inner.sampler, inner.batch_size, inner.drop_last, replicas, replica)
    if indexed:
        shares = _IndexBatchSamplerWrapper(shares)  # type: ignore[arg-type]
    if type(dataloader) is DataLoader:
        return DataLoader(dataloader.dataset, batch_sampler=shares, **{
            name: getattr(dataloader, name) for name in _KEPT if hasattr(dataloader, name)})
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, inner.sampler)  # a subclass: as Lightning does
    kwargs.update(batch_sampler=shares, sampler=None, batch_size=1, shuffle=False, drop_last=False)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


#: what a DataLoader keeps of its arguments, other than how it samples
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")
