"""Deferred BatchNorm statistics: running statistics from the whole batch, not from each micro-batch.

In a pipeline every BatchNorm layer sees one micro-batch at a time. Normalising each micro-batch by
its own statistics is accepted (as in GPipe: whole-batch statistics would couple the micro-batches
and serialise the pipeline), so training outputs differ from whole-batch training. The running
statistics, however, would be updated ``chunks`` times per step from small samples. With deferral
they are updated once per step, from the statistics of all the micro-batches together, which is
exactly what the plain module would have stored after a step on the whole batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_private import BatchNormBase

_again = threading.local()
"""``active`` while a forward runs again for its backward (:func:`recomputing`), in this thread."""


class _Moments:
    """Per-channel sums of one layer's inputs over a step, in float64, held as non-persistent
    buffers of the layer while the step runs and summed in place: so whatever backs up and
    restores a module's buffers around a trial forward (torch's pipelining stages, before their
    first step) restores these too."""

    NAMES = ("_deferred_total", "_deferred_squares", "_deferred_count")

    def __init__(self, module: BatchNormBase) -> None:
        self.module = module
        device, channels = module.running_mean.device, module.running_mean.shape[0]
        module.register_buffer(self.NAMES[0], torch.zeros(channels, dtype=torch.float64, device=device), False)
        module.register_buffer(self.NAMES[1], torch.zeros(channels, dtype=torch.float64, device=device), False)
        module.register_buffer(self.NAMES[2], torch.zeros((), dtype=torch.int64, device=device), False)

    @property
    def total(self) -> torch.Tensor:
        return getattr(self.module, self.NAMES[0])

    @property
    def squares(self) -> torch.Tensor:
        return getattr(self.module, self.NAMES[1])

    @property
    def count(self) -> int:
        return int(getattr(self.module, self.NAMES[2]))

    def add(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            self.total.add_(x.sum(dims, dtype=torch.float64))
            self.squares.add_((x.double() ** 2).sum(dims))
            getattr(self.module, self.NAMES[2]).add_(x.numel() // x.shape[1])

    def remove(self) -> None:
        for name in self.NAMES:
            delattr(self.module, name)


@contextmanager
def deferred_batch_norm(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, BatchNorm layers in training mode normalise without touching their running
    statistics and record their inputs' moments; on leaving it, each updates its running statistics
    once, as the plain layer would have on the whole batch."""
    norms = [m for m in modules if isinstance(m, BatchNormBase) and m.training and m.track_running_stats]
    moments = {id(m): _Moments(m) for m in norms}
    for module in norms:
        module.forward = _recording_forward(module, moments[id(module)])  # instance attribute wins
    try:
        yield
        for module in norms:
            _update_running_stats(module, moments[id(module)])
    finally:
        for module in norms:
            del module.forward
            moments[id(module)].remove()


class recomputing:  # noqa: N801 - used as a context manager, like contextlib's
    """A forward run again to recompute what its backward needs, after it already ran once: the
    BatchNorm layers among ``modules`` normalise as they did, but their running statistics (and
    deferred moments) are not updated a second time. Their momentum is 0 within the block, and the
    count of batches tracked is put back after it. A graph that updates ``buffers`` itself (an
    exported graph reads the running statistics and writes them back in place, whatever the
    module's momentum) has each buffer it changed put back: at the end of the block, or, with
    ``restore_later``, when :meth:`restore` is called (after the backward that may read them). The
    block may be entered again and again (a backward split in two recomputes twice). Both runtimes
    recompute through it."""

    def __init__(self, modules: Iterable[nn.Module], buffers: Iterable[torch.Tensor] = (),
                 restore_later: bool = False) -> None:
        self.norms = [m for m in modules if isinstance(m, BatchNormBase) and m.training and m.track_running_stats]
        self.buffers = list(buffers)
        self.restore_later = restore_later
        self._kept: list[list[tuple[float | None, torch.Tensor]]] = []
        self._was: list[bool] = []
        self._values: list[list[torch.Tensor]] = []

    def __enter__(self) -> recomputing:
        self._kept.append([(m.momentum, m.num_batches_tracked.clone()) for m in self.norms])
        self._values.append([b.clone() for b in self.buffers])
        self._was.append(getattr(_again, "active", False))
        _again.active = True
        for module in self.norms:
            module.momentum = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        _again.active = self._was.pop()
        for module, (momentum, tracked) in zip(self.norms, self._kept.pop()):
            module.momentum = momentum
            with torch.no_grad():
                module.num_batches_tracked.copy_(tracked)
        if not self.restore_later:
            self.restore()

    def restore(self) -> None:
        """Put back each buffer the block changed (one untouched keeps its version)."""
        values = self._values.pop()
        with torch.no_grad():
            for buffer, value in zip(self.buffers, values):
                if not torch.equal(buffer, value):
                    buffer.copy_(value)


def _recording_forward(module: BatchNormBase, moments: _Moments):
    def forward(x: torch.Tensor) -> torch.Tensor:
        module._check_input_dim(x)
        if not getattr(_again, "active", False):
            moments.add(x)
        return F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)

    return forward


def _update_running_stats(module: BatchNormBase, moments: _Moments) -> None:
    n = moments.count
    if n == 0:
        return
    mean = moments.total / n
    variance = (moments.squares / n - mean**2).clamp_min(0) * (n / max(n - 1, 1))
    with torch.no_grad():
        module.num_batches_tracked.add_(1)
        momentum = module.momentum
        factor = 1.0 / float(module.num_batches_tracked) if momentum is None else momentum
        module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype), alpha=factor)
        module.running_var.mul_(1 - factor).add_(variance.to(module.running_var.dtype), alpha=factor)
