"""Joining the micro-batches' outputs back into one call's result.

Each output leaf is joined on its batch dim: the one dim whose size follows the micro-batch sizes,
or, where several do (a ``[3, 3]`` output of 3-sample micro-batches), the one that grows when the
batch grows by a sample; an output that grows in more than one dim relates samples to each other
and cannot be joined. The values ``forward`` only assigns to attributes are taken out of the
outputs first, and given to the attributes as a whole-batch call would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.batch_axis import batch_dim_candidates
from ..capture.pytrees import flatten, unflatten
from .microbatch import MicroBatchError
from .model_loss import WeightedSum

Shape = tuple[int, ...] | None
MicroOutputs = list[tuple[list[Any], Any]]
"""Each micro-batch's output leaves and the spec that nests them."""


@dataclass
class Assigned:
    """Per micro-batch, the output values kept only for attributes ``forward`` assigns (by node
    name); and which of the last stage's output leaves the caller gets (``None``: all of them), so
    backward can hand the stages a gradient slot for every leaf."""

    values: list[dict[str, Any]] = field(default_factory=list)
    leaf_positions: list[int] | None = None
    leaf_count: int = 0


def take_assigned(outputs: MicroOutputs, returned_slots: Sequence[int], assigned_slots: Mapping[str, int]
                  ) -> tuple[MicroOutputs, Assigned]:
    """Each micro-batch's outputs less the values only kept for attributes (by output slot), and
    those values by name, with where the returned leaves sit among all."""
    if not assigned_slots:
        return outputs, Assigned()
    returned, taken = [], Assigned()
    for leaves, spec in outputs:
        values = unflatten(leaves, spec)
        returned.append(flatten(tuple(values[i] for i in returned_slots)))
        taken.values.append({name: values[i] for name, i in assigned_slots.items()})
        offsets = [0]
        for i in range(spec.num_children):
            offsets.append(offsets[-1] + spec.child(i).num_leaves)
        taken.leaf_positions = [p for i in returned_slots for p in range(offsets[i], offsets[i + 1])]
        taken.leaf_count = offsets[-1]
    return returned, taken


def output_dims(outputs: MicroOutputs, sizes: Sequence[int | None],
                grown_shapes: Callable[[], Sequence[Shape]],
                rows_in_sample_order: Callable[[], Sequence[bool | None]] | None = None,
                loss_weights: Callable[[int], WeightedSum] | None = None) -> list[int | WeightedSum | None]:
    """The batch dim of each output leaf; ``grown_shapes()`` gives the leaves' shapes for a first
    micro-batch one sample larger, asked only where the sizes cannot tell.

    An output with no such dim whose dim 0 is a fixed multiple of the micro-batch sizes (samples ×
    tokens, as ``output.view(-1, vocab)`` gives) is joined on dim 0, where
    ``rows_in_sample_order()`` says its rows hold each sample's rows together, in sample order;
    where they do not (tokens × samples), joining would interleave the micro-batches wrongly, and
    is refused. A 0-dim floating-point output (a loss the model computes) joins as the weighted sum
    ``loss_weights(i)`` finds for leaf ``i`` (:mod:`.model_loss`)."""
    micro_leaves = [leaves for leaves, _ in outputs]
    dims: list[int | WeightedSum | None] = []
    for i, value in enumerate(micro_leaves[0]):
        if not isinstance(value, torch.Tensor):
            dims.append(None)
            continue
        if value.dim() == 0 and value.is_floating_point() and loss_weights is not None:
            dims.append(loss_weights(i))
            continue
        chunks = [leaves[i] for leaves in micro_leaves]
        candidates = batch_dim_candidates(chunks, sizes)
        if not candidates and flattened_rows(chunks, sizes) is not None:
            in_order = rows_in_sample_order()[i] if rows_in_sample_order is not None and len(chunks) > 1 else True
            if in_order is False:
                raise MicroBatchError(interleaved_rows_message(tuple(value.shape), flattened_rows(chunks, sizes),
                                                               "changing one sample changed rows of others"))
            dims.append(0 if in_order else None)  # None: no row changed with its sample (from the weights?)
            continue
        if len(candidates) <= 1:
            dims.append(candidates[0] if candidates else None)
            continue
        grew = grown_dims(value, grown_shapes()[i], candidates)
        if len(grew) != 1:
            raise MicroBatchError(
                f"an output of shape {tuple(value.shape)} grows in dims {grew} when the batch grows: it "
                "relates samples to each other (a [batch, batch] similarity, say), so it cannot be joined from "
                "micro-batches. Compute it outside the pipelined module, from per-sample outputs."
            )
        dims.append(grew[0])
    return dims


def interleaved_rows_message(shape: tuple[int, ...], rows: int | None, evidence: str) -> str:
    """Why an output flattened over samples and rows in another order than sample by sample is refused."""
    return (f"an output of shape {shape} holds {rows} rows per sample on dim 0, but not sample by sample: {evidence}, "
            "so its rows are ordered another way (rows × samples, as x.transpose(0, 1).reshape(-1, n) gives). "
            "Joining micro-batches on dim 0 would mix their rows up. Flatten with the samples first (x.reshape(-1, n) "
            "on a batch-first tensor), or return the output unflattened.")


def flattened_rows(chunks: Sequence[torch.Tensor], sizes: Sequence[int | None]) -> int | None:
    """The rows per sample of an output whose dim 0 is the same multiple (2 or more) of every
    micro-batch's size, its other dims equal; ``None`` for any other output."""
    if any(n is None or n == 0 for n in sizes) or chunks[0].dim() == 0:
        return None
    first = chunks[0]
    rows, left = divmod(first.shape[0], sizes[0])  # type: ignore[operator]
    if rows < 2 or left:
        return None
    if all(c.dim() == first.dim() and c.shape[0] == rows * n and c.shape[1:] == first.shape[1:]
           for c, n in zip(chunks, sizes)):
        return rows
    return None


def rows_in_sample_order(before: Sequence[Any], after: Sequence[Any], samples: int,
                         rows_per_sample: Sequence[int | None]) -> list[bool | None]:
    """Per output leaf, from two runs of one micro-batch of ``samples`` samples that differ only in
    its last sample (same random draws): whether only that sample's rows, the last on dim 0,
    changed (``True``), rows before them changed (``False``), or nothing changed (``None``)."""
    verdicts: list[bool | None] = []
    for a, b, rows in zip(before, after, rows_per_sample):
        if rows is None or not isinstance(a, torch.Tensor):
            verdicts.append(None)
            continue
        kept = (samples - 1) * rows
        if not torch.allclose(a[:kept], b[:kept], rtol=1e-5, atol=1e-6 * float(a.abs().max().clamp(min=1))):
            verdicts.append(False)
        else:
            verdicts.append(True if not torch.equal(a[kept:], b[kept:]) else None)
    return verdicts


def assigned_dim(values: Sequence[torch.Tensor], sizes: Sequence[int | None], grown_shape: Callable[[], Shape]
                 ) -> int | None:
    """The batch dim of a per-sample value ``forward`` assigns to an attribute, as for outputs."""
    candidates = batch_dim_candidates(list(values), sizes)
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    grew = grown_dims(values[0], grown_shape(), candidates)
    return grew[0] if len(grew) == 1 else None


def grown_dims(value: torch.Tensor, larger: Shape, candidates: Sequence[int]) -> list[int]:
    """The candidate dims that grew by a sample."""
    if larger is None or len(larger) != value.dim():
        return []
    return [d for d in candidates if larger[d] == value.shape[d] + 1]
