"""Split a batch into micro-batches and put the outputs back together.

Any nesting of tuples, lists and dicts is handled. Tensors with at least one dimension are split on
their batch dim, dim 0 unless told otherwise (all of them must have the same batch size); scalars,
0-dim tensors and other values are handed unchanged to every micro-batch. Sizes differ by at most
one sample (``torch.tensor_split``): 10 samples in 4 chunks are 3, 3, 2, 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..capture.batch_axis import batch_dim_candidates


class MicroBatchError(ValueError):
    """The batch cannot be split as asked, or the outputs cannot be gathered."""


BatchDims = int | Sequence[Any] | Mapping[Any, Any]
"""Where the batch is in a value: one dim for every tensor in it, or, for a tuple, list or dict, the
same container holding the dims of its items (dict keys left out have dim 0)."""


def batch_size(value: Any, dims: BatchDims = 0) -> int | None:
    """The common batch size of the tensors in ``value``; ``None`` if it holds no batched tensor."""
    sizes = {t.shape[d] for t, d in batched_tensors(value, dims)}
    if len(sizes) > 1:
        raise MicroBatchError(
            f"the tensors of one batch have different batch sizes ({sorted(sizes)}); every tensor input is "
            "split on its batch dim into micro-batches, so they must agree. Pass per-batch constants as Python "
            "values or 0-dim tensors, and say where the batch is with batch_dim= if it is not dim 0."
        )
    return sizes.pop() if sizes else None


def scatter(value: Any, chunks: int, dims: BatchDims = 0) -> list[Any]:
    """``value`` split into ``min(chunks, batch size)`` micro-batches of the same structure."""
    if chunks < 1:
        raise MicroBatchError(f"chunks must be at least 1, got {chunks}")
    size = batch_size(value, dims)
    count = chunks if size is None else min(chunks, size)
    if size == 0:
        raise MicroBatchError("cannot pipeline an empty batch")
    return [_take(value, i, count, dims) for i in range(count)]


def _take(value: Any, index: int, count: int, dims: BatchDims) -> Any:
    return map_batched(value, dims, lambda t, d: torch.tensor_split(t, count, dim=d)[index])


def map_batched(value: Any, dims: BatchDims, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """``value`` with ``fn(tensor, batch_dim)`` applied to every batched tensor, structure kept."""
    if isinstance(value, torch.Tensor):
        assert isinstance(dims, int)
        return fn(value, dims) if _has_batch(value, dims) else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_batched(v, _item_dims(dims, i), fn) for i, v in enumerate(value)))
    if isinstance(value, (tuple, list)):
        return type(value)(map_batched(v, _item_dims(dims, i), fn) for i, v in enumerate(value))
    if isinstance(value, dict):
        return type(value)((k, map_batched(v, _item_dims(dims, k), fn)) for k, v in value.items())
    return value


def _item_dims(dims: BatchDims, key: Any) -> BatchDims:
    if isinstance(dims, int):
        return dims
    if isinstance(dims, Mapping):
        return dims.get(key, 0)
    return dims[key]


def _has_batch(tensor: torch.Tensor, dim: int) -> bool:
    """0-dim tensors are constants; a tensor with a batch dim past its last one is an error, since a
    per-sample tensor (lengths, labels) would otherwise reach every micro-batch whole."""
    if tensor.dim() == 0:
        return False
    if tensor.dim() <= dim:
        raise MicroBatchError(
            f"batch_dim={dim}, but an input of shape {tuple(tensor.shape)} has no dim {dim}. Give each input its "
            "own batch dim, e.g. batch_dim={'x': 1, 'lengths': 0}, by forward's argument names."
        )
    return True


def batched_tensors(value: Any, dims: BatchDims) -> Iterator[tuple[torch.Tensor, int]]:
    """Every batched tensor of ``value`` with its batch dim, in the order :func:`map_batched` visits them."""
    if isinstance(value, torch.Tensor):
        assert isinstance(dims, int)
        if _has_batch(value, dims):
            yield value, dims
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from batched_tensors(v, _item_dims(dims, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from batched_tensors(v, _item_dims(dims, k))


def gather(chunks: Sequence[Any], device: torch.device | str | None = None,
           sizes: Sequence[int | None] | None = None, dims: Sequence[Any] | None = None) -> Any:
    """The micro-batch outputs joined back on their batch dim (on ``device`` if given), structure kept.

    Non-tensor values are taken from the first micro-batch. Only per-sample tensors can be joined:
    with ``sizes`` (the samples of each micro-batch), a tensor's batch dim is the one that follows
    them (dim 0 where several do), and a tensor with none (a sum over the batch, a value computed
    from the weights) is an error, since joining it would silently give another value than the
    whole batch would; so is a 0-dim tensor. ``dims`` gives the batch dim of each item of a list of
    outputs where the caller has found it (``None``: it has none), for outputs the sizes cannot tell,
    or the weights a loss joins by (:class:`~.model_loss.WeightedSum`).
    """
    if dims is not None:
        return [_join([c[i] for c in chunks], device, sizes, dim) if isinstance(chunks[0][i], torch.Tensor)
                else chunks[0][i] for i, dim in enumerate(dims)]
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return _join(chunks, device, sizes, 0 if sizes is None else output_batch_dim(chunks, sizes))
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather([c[i] for c in chunks], device, sizes) for i in range(len(first))))
    if isinstance(first, (tuple, list)):
        return type(first)(gather([c[i] for c in chunks], device, sizes) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)((k, gather([c[k] for c in chunks], device, sizes)) for k in first)
    return first


def _join(chunks: Sequence[torch.Tensor], device: torch.device | str | None, sizes: Sequence[int | None] | None,
          dim: Any) -> torch.Tensor:
    weights = getattr(dim, "weights", None)
    if weights is not None:  # a loss: model_loss.WeightedSum
        target = device or chunks[0].device
        return sum((w * c.to(target) for w, c in zip(weights[1:], chunks[1:])), weights[0] * chunks[0].to(target))
    if chunks[0].dim() == 0:
        raise MicroBatchError(
            "the pipelined module returned a 0-dim tensor that is not a floating-point loss; outputs must keep "
            "the batch on a dim so the micro-batches can be joined. Compute it outside the module."
        )
    if dim is None:
        shapes = [tuple(c.shape) for c in chunks]
        same = len(set(shapes)) == 1
        raise MicroBatchError(
            f"the pipelined module returned a tensor with no dim that follows the samples: shapes {shapes} for "
            f"micro-batches of {list(sizes or [])} samples"
            + (", the same whatever the micro-batch holds (a sum or mean over the batch, or a value computed "
               "from the weights alone)" if same else ", and no dim is one entry (or a fixed number of rows) per "
               "sample") +
            ". Joining those would not give what the whole batch gives. Return per-sample outputs (a loss "
            "module's reduction='none', or logits), compute the rest outside the pipelined module, or pipeline a "
            "submodule with module=..."
        )
    return torch.cat([c if device is None else c.to(device) for c in chunks], dim=dim)


def output_batch_dim(chunks: Sequence[torch.Tensor], sizes: Sequence[int | None]) -> int | None:
    """The dim of an output that holds one entry per sample in every micro-batch (others equal)."""
    candidates = batch_dim_candidates(chunks, sizes)
    if not candidates:
        return None
    return 0 if 0 in candidates else candidates[0]
