"""Split a batch into micro-batches and put the outputs back together.

Any nesting of tuples, lists and dicts is handled. Tensors with at least one dimension are split on
their batch dim, dim 0 unless told otherwise (all of them must have the same batch size); scalars,
0-dim tensors and other values are handed unchanged to every micro-batch, except, where asked
(``lists=True``), a list of plain values with one entry per sample (the ``list[str]`` of names a
DataLoader collates), which is split with the samples. Sizes differ by at most one sample
(``torch.tensor_split``): 10 samples in 4 chunks are 3, 3, 2, 2.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..capture.batch_axis import batch_dim_candidates
from .model_loss import join_weights


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


def scatter(value: Any, chunks: int, dims: BatchDims = 0, lists: bool = False) -> list[Any]:
    """``value`` split into ``min(chunks, batch size)`` micro-batches of the same structure;
    with ``lists``, its lists of plain values with an entry per sample too (:func:`is_sample_list`)."""
    if chunks < 1:
        raise MicroBatchError(f"chunks must be at least 1, got {chunks}")
    size = batch_size(value, dims)
    count = chunks if size is None else min(chunks, size)
    if size == 0:
        raise MicroBatchError("cannot pipeline an empty batch")
    if not lists or size is None:
        return [_take(value, i, count, dims) for i in range(count)]
    bounds = [0, *itertools.accumulate(split_sizes(size, chunks))]
    return [map_batched(value, dims, lambda t, d, i=i: torch.tensor_split(t, count, dim=d)[i],
                        samples=(size, lambda entries, i=i: entries[bounds[i]:bounds[i + 1]])) for i in range(count)]


def split_sizes(size: int, chunks: int) -> list[int]:
    """The sizes of the micro-batches :func:`scatter` makes of ``size`` samples: ``min(chunks,
    size)`` of them, differing by one sample at most, the larger first."""
    count = max(min(chunks, size), 1)
    return [size // count + (1 if i < size % count else 0) for i in range(count)]


def _take(value: Any, index: int, count: int, dims: BatchDims) -> Any:
    return map_batched(value, dims, lambda t, d: torch.tensor_split(t, count, dim=d)[index])


PLAIN = (bool, int, float, str, bytes, type(None))
"""The types of the values a per-sample list holds."""


def is_sample_list(value: Any, size: int | None) -> bool:
    """Whether ``value`` is a list or tuple (not a named tuple) of ``size`` plain values: an entry
    per sample of a batch of ``size``, such as the names a DataLoader collates into a ``list[str]``."""
    return (size is not None and isinstance(value, (list, tuple)) and not hasattr(value, "_fields")
            and len(value) == size and all(isinstance(v, PLAIN) for v in value))


def map_batched(value: Any, dims: BatchDims, fn: Callable[[torch.Tensor, int], torch.Tensor],
                samples: tuple[int, Callable[[Any], Any]] | None = None) -> Any:
    """``value`` with ``fn(tensor, batch_dim)`` applied to every batched tensor, structure kept;
    ``samples``: a batch size and what to make of each per-sample list (:func:`is_sample_list`)."""
    if isinstance(value, torch.Tensor):
        assert isinstance(dims, int)
        return fn(value, dims) if _has_batch(value, dims) else value
    if samples is not None and is_sample_list(value, samples[0]):
        return type(value)(samples[1](value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_batched(v, _item_dims(dims, i), fn, samples) for i, v in enumerate(value)))
    if isinstance(value, (tuple, list)):
        return type(value)(map_batched(v, _item_dims(dims, i), fn, samples) for i, v in enumerate(value))
    if isinstance(value, dict):
        return type(value)((k, map_batched(v, _item_dims(dims, k), fn, samples)) for k, v in value.items())
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
    """One tensor of every micro-batch joined: on ``dim``, or as the weighted sum a loss joins by
    (:class:`~.model_loss.WeightedSum`); both runtimes' joins end here."""
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


def join_results(results: Sequence[Any], sizes: Sequence[int]) -> Any:
    """What a step hook returned for each micro-batch of ``sizes`` samples, as one result for their
    whole batch, structure kept: tensors joined on the dim that follows the samples, per-sample
    lists (:func:`is_sample_list`) concatenated, a 0-dim floating-point tensor (a loss, a mean) as
    the mean weighted by the samples; anything else must be the same for every micro-batch. What
    cannot be joined is refused, since any other value would differ from the whole batch's."""
    first = results[0]
    if all(isinstance(r, torch.Tensor) for r in results):
        if first.dim() == 0 and first.is_floating_point():
            return _join(results, None, sizes, join_weights(sizes, summed=False))
        dim = output_batch_dim(results, sizes) if first.dim() > 0 else None
        if dim is not None:
            return _join(results, None, sizes, dim)
        if all(r.shape == first.shape and torch.equal(r, first) for r in results[1:]):
            return first
        raise MicroBatchError(
            f"a step returned a tensor of shape {tuple(first.shape)} with no dim that follows the micro-batches' "
            f"samples ({list(sizes)}), and values that differ between them, so nothing tells what the whole batch's "
            "would be. Return per-sample tensors (one row per sample) or a floating-point mean.")
    if all(is_sample_list(r, n) for r, n in zip(results, sizes)):
        return type(first)(v for r in results for v in r)
    if isinstance(first, dict) and all(isinstance(r, dict) and r.keys() == first.keys() for r in results):
        return type(first)((k, join_results([r[k] for r in results], sizes)) for k in first)
    if isinstance(first, (list, tuple)) and all(type(r) is type(first) and len(r) == len(first) for r in results):
        joined = [join_results([r[i] for r in results], sizes) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    if all(same_value(r, first) for r in results[1:]):
        return first
    raise MicroBatchError(
        f"a step returned {type(first).__name__} values that differ between micro-batches ({results[0]!r}, "
        f"{results[1]!r}, ...), so nothing tells what the whole batch's would be. Return per-sample values (a tensor "
        "with a row per sample, a list with an entry per sample) or a floating-point mean.")


def same_value(a: Any, b: Any) -> bool:
    """Whether two plain values are equal (those that do not compare are not)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return a is b
