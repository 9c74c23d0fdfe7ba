"""Deferred BatchNorm statistics: running statistics from the whole batch, not from each micro-batch.

In a pipeline every BatchNorm layer sees one micro-batch at a time. Normalising each micro-batch by
its own statistics is accepted (as in GPipe: whole-batch statistics would couple the micro-batches
and serialise the pipeline), so training outputs differ from whole-batch training. The running
statistics, however, would be updated ``chunks`` times per step from small samples. With deferral
they are updated once per step, from the statistics of all the micro-batches together, which is
exactly what the plain module would have stored after a step on the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _Moments:
    """Per-channel sums of one layer's inputs over a step, in float64."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            total = x.sum(dims, dtype=torch.float64)
            squares = (x.double() ** 2).sum(dims)
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += x.numel() // x.shape[1]


@contextmanager
def deferred_batch_norm(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, BatchNorm layers in training mode normalise without touching their running
    statistics and record their inputs' moments; on leaving it, each updates its running statistics
    once, as the plain layer would have on the whole batch."""
    norms = [m for m in modules if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    moments = {id(m): _Moments() for m in norms}
    for module in norms:
        module.forward = _recording_forward(module, moments[id(module)])  # instance attribute wins
    try:
        yield
    finally:
        for module in norms:
            del module.forward
    for module in norms:
        _update_running_stats(module, moments[id(module)])


def _recording_forward(module: _BatchNorm, moments: _Moments):
    def forward(x: torch.Tensor) -> torch.Tensor:
        module._check_input_dim(x)
        moments.add(x)
        return F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)

    return forward


def _update_running_stats(module: _BatchNorm, moments: _Moments) -> None:
    if moments.count == 0 or moments.total is None or moments.squares is None:
        return
    n = moments.count
    mean = moments.total / n
    variance = (moments.squares / n - mean**2).clamp_min(0) * (n / max(n - 1, 1))
    with torch.no_grad():
        module.num_batches_tracked.add_(1)
        momentum = module.momentum
        factor = 1.0 / float(module.num_batches_tracked) if momentum is None else momentum
        module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype), alpha=factor)
        module.running_var.mul_(1 - factor).add_(variance.to(module.running_var.dtype), alpha=factor)
