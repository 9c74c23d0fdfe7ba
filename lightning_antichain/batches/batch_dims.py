"""Where the samples are in each input: ``batch_dim``, as DataParallel's ``dim``, per input if needed.

Most models take ``[batch, ...]``; a sequence-first ``nn.GRU`` or ``nn.Transformer`` takes
``[time, batch, ...]``. Splitting dim 0 there splits time, and every step would train silently on
the wrong thing. ``batch_dim=1`` says so for every input; ``{"x": 1, "lengths": 0}`` names
``forward``'s arguments that differ (the others are on dim 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..capture import OpGraph
from ..capture.signature import FlatSignature, FxSignature, original_forward
from ..torch_private import pytree
from . import microbatch

BatchDim = int | Mapping[str, int]


def check_batch_dim(batch_dim: Any) -> BatchDim:
    """``batch_dim`` if it is a non-negative int or a dict of them by argument name, else a clear error."""
    def valid(d: Any) -> bool:
        return isinstance(d, int) and not isinstance(d, bool) and d >= 0

    if valid(batch_dim) or (isinstance(batch_dim, Mapping) and all(
            isinstance(k, str) and valid(d) for k, d in batch_dim.items())):
        return batch_dim
    raise ValueError(
        f"batch_dim is the dim of the inputs that holds the samples: a whole number >= 0, or a dict of them by "
        f"forward's argument names (e.g. {{'x': 1, 'lengths': 0}}); got {batch_dim!r}"
    )


def placeholder_batch_dims(graph: OpGraph, batch_dim: BatchDim) -> list[int]:
    """The batch dim of each value :meth:`OpGraph.bind` gives, in order."""
    signature = graph.signature
    if isinstance(batch_dim, int):
        count = len(signature.placeholders) if isinstance(signature, FxSignature) else signature.in_spec.num_leaves
        return [batch_dim] * count
    if isinstance(signature, FxSignature):
        names = [str(p.target).lstrip("*") for p in signature.placeholders]
    else:
        assert isinstance(signature, FlatSignature)
        args, kwargs = pytree.tree_unflatten(list(range(signature.in_spec.num_leaves)), signature.in_spec)
        names = [""] * signature.in_spec.num_leaves
        for name, value in kwargs.items():
            for index in pytree.tree_leaves(value):
                names[index] = name
    unknown = sorted(set(batch_dim) - set(names))
    if unknown:
        raise ValueError(f"batch_dim names {unknown}, but {signature.owner}() takes {sorted(set(names) - {''})}")
    return [batch_dim.get(name, 0) for name in names]


def call_dims(module: nn.Module, args: tuple, kwargs: dict, batch_dim: BatchDim) -> tuple[tuple, dict, Any]:
    """A call and the batch dims of its ``(args, kwargs)`` (see :data:`microbatch.BatchDims`): with
    dims by argument name, the call is first put with every argument named."""
    if isinstance(batch_dim, int):
        return args, kwargs, batch_dim
    args, kwargs = FlatSignature.canonical(original_forward(module), args, kwargs)
    return args, kwargs, (0, dict(batch_dim))


def first_micro_batch(module: nn.Module, args: tuple, kwargs: dict, chunks: int, batch_dim: BatchDim) -> tuple:
    """The first micro-batch of a call, as ``(args, kwargs)``, split on the batch dims."""
    args, kwargs, dims = call_dims(module, args, kwargs, batch_dim)
    return microbatch.scatter((args, kwargs), chunks, dims)[0]


def batch_size_of(module: nn.Module, args: tuple, kwargs: dict, batch_dim: BatchDim) -> int | None:
    """The number of samples in a call."""
    args, kwargs, dims = call_dims(module, args, kwargs, batch_dim)
    return microbatch.batch_size((args, kwargs), dims)


def grown_by_one(values: list[Any], dims: list[int]) -> list[Any]:
    """``values`` with one more sample (the first, repeated) on each batched tensor's batch dim."""
    return microbatch.map_batched(values, dims, lambda t, d: torch.cat([t, t.narrow(d, 0, 1)], d))


def with_samples_of(values: list[Any], donor: list[Any], dims: list[int], samples: slice) -> list[Any]:
    """``values`` with ``samples`` of ``donor`` (another micro-batch's values, alike in structure)
    appended on each batched tensor's batch dim."""
    def taken(t: torch.Tensor, d: int) -> torch.Tensor:
        return t[(slice(None),) * d + (samples,)]

    extra = iter([taken(t, d) for t, d in microbatch.batched_tensors(donor, dims)])
    return microbatch.map_batched(values, dims, lambda t, d: torch.cat([t, next(extra).to(t.device)], d))
