"""Split a batch into micro-batches and put the outputs back together.

Any nesting of tuples, lists and dicts is handled. Tensors with at least one dimension are split on
dim 0 (all of them must have the same batch size); scalars, 0-dim tensors and other values are
handed unchanged to every micro-batch. Sizes differ by at most one sample (``torch.tensor_split``):
10 samples in 4 chunks are 3, 3, 2, 2.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .trace import iter_tensors


class MicroBatchError(ValueError):
    """The batch cannot be split as asked, or the outputs cannot be gathered."""


def batch_size(value: Any) -> int | None:
    """The common size of dim 0 of the tensors in ``value``; ``None`` if it holds no batched tensor."""
    sizes = {t.shape[0] for t in _batched_tensors(value)}
    if len(sizes) > 1:
        raise MicroBatchError(
            f"the tensors of one batch have different sizes on dim 0 ({sorted(sizes)}); every tensor "
            "input is split on dim 0 into micro-batches, so they must agree. Pass per-batch constants "
            "as Python values or 0-dim tensors."
        )
    return sizes.pop() if sizes else None


def scatter(value: Any, chunks: int) -> list[Any]:
    """``value`` split into ``min(chunks, batch size)`` micro-batches of the same structure."""
    if chunks < 1:
        raise MicroBatchError(f"chunks must be at least 1, got {chunks}")
    size = batch_size(value)
    count = chunks if size is None else min(chunks, size)
    if size == 0:
        raise MicroBatchError("cannot pipeline an empty batch")
    return [_take(value, i, count) for i in range(count)]


def _take(value: Any, index: int, count: int) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.tensor_split(value, count)[index] if value.dim() > 0 else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_take(v, index, count) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, index, count) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _take(v, index, count)) for k, v in value.items())
    return value


def gather(chunks: Sequence[Any], device: torch.device | str | None = None,
           sizes: Sequence[int | None] | None = None) -> Any:
    """The micro-batch outputs joined back on dim 0 (on ``device`` if given), structure kept.

    Non-tensor values are taken from the first micro-batch. Only per-sample tensors can be joined:
    with ``sizes`` (the samples of each micro-batch), a tensor whose dim 0 does not follow them (a
    sum over the batch, a value computed from the weights) is an error, since joining it would
    silently give another value than the whole batch would; so is a 0-dim tensor.
    """
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise MicroBatchError(
                "the pipelined module returned a 0-dim tensor; outputs must keep the batch on dim 0 so "
                "the micro-batches can be joined. Reduce (e.g. compute the loss) outside the module."
            )
        if sizes is not None and any(n is not None and c.shape[0] != n for c, n in zip(chunks, sizes)):
            shapes = [tuple(c.shape) for c in chunks]
            raise MicroBatchError(
                f"the pipelined module returned a tensor that is not one row per sample: shapes {shapes} for "
                f"micro-batches of {list(sizes)} samples (a sum over the batch, or a value computed from the "
                "weights?). Joining those on dim 0 would not give what the whole batch gives. Return only "
                "per-sample outputs and compute the rest outside the pipelined module (or pipeline a submodule "
                "with module=...)."
            )
        parts = [c if device is None else c.to(device) for c in chunks]
        return torch.cat(parts, dim=0)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather([c[i] for c in chunks], device, sizes) for i in range(len(first))))
    if isinstance(first, (tuple, list)):
        return type(first)(gather([c[i] for c in chunks], device, sizes) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)((k, gather([c[k] for c in chunks], device, sizes)) for k in first)
    return first


def _batched_tensors(value: Any) -> Iterator[torch.Tensor]:
    return (t for t in iter_tensors(value) if t.dim() > 0)
