"""Whether micro-batching keeps each sample's result: a ``forward`` whose samples depend on each other is refused.

Pipelining runs a batch as micro-batches and joins their outputs. That is the whole batch's output
only where each sample's result depends on that sample alone. ``x - x.mean(0)``, a position taken
from the batch's size, or a per-sample list handed whole to every micro-batch would silently train
another model, so the first call is checked: the module run on the whole batch against its
micro-batches, and a batch with one sample changed against the one before.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..capture.isolation import attributes_restored, own_forward, side_effects_undone
from ..capture.signature import original_forward
from ..device import full_precision_float32
from ..torch_private import pytree
from . import microbatch
from .batch_dims import BatchDim, batch_size_of, call_dims
from .output_join import interleaved_rows_message


class BatchDependenceError(ValueError):
    """``forward`` on a batch is not its micro-batches' outputs joined: micro-batching would change it."""


def check_micro_batchable(module: nn.Module, args: tuple, kwargs: dict, batch_dim: BatchDim) -> None:
    """Refuse a ``forward`` whose result depends on the batch it is in (``x + torch.arange(x.shape[0])``,
    ``x - x.mean(0)``), by running ``module`` itself as :func:`check_per_sample` says."""
    args, kwargs, dims = call_dims(module, args, kwargs, batch_dim)
    with own_forward(module):
        check_per_sample(module, (args, kwargs), dims, lambda call: module(*call[0], **call[1]))


def refuse_per_sample_lists(module: nn.Module, args: tuple, kwargs: dict, batch_dim: BatchDim) -> None:
    """Refuse a list or tuple of plain values (numbers, strings) with one entry per sample, such as
    ``lengths: list[int]``: micro-batching splits tensors, but hands such a list whole to every
    micro-batch, where it would no longer line up with the samples."""
    size = batch_size_of(module, args, kwargs, batch_dim)
    if size is None or size < 2:
        return
    try:
        named: dict[str, Any] = dict(inspect.signature(original_forward(module)).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        named = {**{f"argument {i}": v for i, v in enumerate(args)}, **kwargs}
    for name, value in named.items():
        found = _per_sample_list(value, name, size)
        if found is not None:
            path, kind = found
            raise BatchDependenceError(
                f"{type(module).__name__}.forward gets {path}, a {kind} of {size} plain values for a batch of {size} "
                "samples: per-sample data, it seems. The pipeline splits tensors into micro-batches, but gives every "
                "micro-batch such a list whole, so it would not line up with the samples. Pass it as a tensor "
                f"(torch.tensor({path})), which is split with the batch. If it is not per sample, pass "
                "check_batch=False."
            )


def _per_sample_list(value: Any, path: str, size: int) -> tuple[str, str] | None:
    """The path and type name of a list or tuple of ``size`` plain values within ``value``."""
    if isinstance(value, (list, tuple)):
        if len(value) == size and all(isinstance(v, (bool, int, float, str)) for v in value):
            return path, type(value).__name__
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return None
    for key, item in items:
        found = _per_sample_list(item, f"{path}[{key!r}]", size)
        if found is not None:
            return found
    return None


def _batch_statistics_in_eval(module: nn.Module) -> str:
    """The first BatchNorm below ``module`` that normalises with its batch's statistics in eval mode
    too (built without running statistics), named for a message; "" if none does."""
    for path, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.running_mean is None:
            return f"{type(sub).__name__} at {path or 'the top'}"
    return ""


def _rows_by_row_then_sample(first: torch.Tensor, second: torch.Tensor, whole: torch.Tensor, size: int,
                             scale: float) -> bool:
    """Whether ``whole`` (``size`` samples) is the halves' outputs flattened row-major over (rows,
    samples) rather than (samples, rows): what ``x.transpose(0, 1).reshape(-1, n)`` gives."""
    if whole.shape[0] % size or whole.shape[0] // size < 2 or first.shape[0] + second.shape[0] != whole.shape[0]:
        return False
    rows = whole.shape[0] // size
    halves = [h.reshape(rows, -1, *h.shape[1:]) for h in (first, second.to(first.device))]
    joined = torch.cat(halves, 1).reshape(whole.shape).to(whole.device)
    return (joined - whole).abs().max().item() <= 1e-3 * max(scale, 1e-6)


def check_per_sample(module: nn.Module, call: Any, dims: Any, run: Callable[[Any], Any]) -> None:
    """Refuse a ``forward`` whose result depends on the batch it is in.

    ``run(call)`` computes ``module``'s outputs on ``call``, a value holding the batch on ``dims``
    (see :data:`microbatch.BatchDims`). It runs in eval mode, without gradients, on ``call`` and on
    its two halves (on ``call`` twice over, for a single sample): each sample's output must not
    change. Eval mode keeps dropout and BatchNorm's batch statistics out, which micro-batching
    changes by design; an output that differs between two runs on the same batch (random numbers
    drawn in eval mode too) is not compared. float32 runs in full precision (no TF32) and the
    tolerance grows with the output dtype's rounding: two batch sizes may run a layer by two
    algorithms. Buffer updates, random draws and attributes assigned in forward are undone.
    Models whose batch dependence is intended (a mixture of experts with a capacity per batch) turn
    the check off with ``check_batch=False``.
    """
    size = microbatch.batch_size(call, dims)
    if size is None:
        return
    if size >= 2:
        parts = microbatch.scatter(call, 2, dims)
    else:
        parts = [call, call]
        call = microbatch.map_batched(call, dims, lambda t, d: torch.cat([t, t], d))
    modes = {m: m.training for m in module.modules()}  # submodules may differ (a frozen BatchNorm)
    try:
        module.train(False)
        with attributes_restored(module), side_effects_undone(module), torch.no_grad(), full_precision_float32():
            whole = run(call)
            halves = [run(part) for part in parts]
            again = run(call)  # random numbers drawn in eval mode too (noise) make an output differ
    finally:
        for m, training in modes.items():
            m.training = training
    for leaves in zip(pytree.tree_leaves(whole), pytree.tree_leaves(again), *(pytree.tree_leaves(h) for h in halves)):
        whole_leaf, repeated, first, second = leaves
        if not all(isinstance(t, torch.Tensor) for t in leaves) or not whole_leaf.is_floating_point():
            continue
        if repeated.shape != whole_leaf.shape or not torch.equal(repeated, whole_leaf):
            continue  # not the same on the same batch: nothing to compare it with
        dim = next((d for d in range(first.dim()) if whole_leaf.dim() == first.dim()
                    and whole_leaf.shape[d] == first.shape[d] + second.shape[d]), None)
        if dim is None:
            continue  # not per-sample: joining it is refused when the pipeline runs
        joined = torch.cat([first, second.to(first.device)], dim).to(whole_leaf.device)
        if joined.shape != whole_leaf.shape:
            continue
        scale = whole_leaf.abs().max().item() if whole_leaf.numel() else 0.0
        error = (joined - whole_leaf).abs().max().item()
        tolerance = max(1e-3, 16 * torch.finfo(whole_leaf.dtype).eps) * max(scale, 1e-6)
        if error > tolerance and _rows_by_row_then_sample(first, second, whole_leaf, size, scale):
            raise microbatch.MicroBatchError(interleaved_rows_message(
                tuple(whole_leaf.shape), whole_leaf.shape[0] // size,
                "the whole batch's rows are the halves' rows interleaved row by row"))
        if error > tolerance and (statistics := _batch_statistics_in_eval(module)):
            raise BatchDependenceError(
                f"{statistics} has no running statistics (track_running_stats=False when it was built), so it "
                "normalises with the statistics of the batch it is given, in eval mode too: micro-batches change "
                f"what {type(module).__name__}.forward gives a sample (off by {error:.3g} when the batch is split in "
                "two), in training and in validation alike. Build it with track_running_stats=True (Lightning's "
                "BaseFinetuning.freeze then keeps the statistics it has), use a norm of each sample (LayerNorm, "
                "GroupNorm), or pipeline a submodule without it (module=...).")
        if error > tolerance:
            raise BatchDependenceError(
                f"{type(module).__name__}.forward gives a sample another output when the batch around it changes "
                f"(off by {error:.3g} on an output of shape {tuple(whole_leaf.shape)} when the batch is split in "
                "two), so running it micro-batch by micro-batch would change the result. It reads the batch size "
                "or mixes samples (x + torch.arange(x.shape[0]), a mean over dim 0). Make it per sample, pipeline "
                "a submodule that is (module=...), or, if the model means it (a mixture of experts with a "
                "capacity per batch), pass check_batch=False and accept that micro-batches change its result."
            )
