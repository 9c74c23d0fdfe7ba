"""Capture leaves the user's module as it found it.

Capture records the user's ``forward``, so it must run the class's own ``forward`` even while the
strategy has installed the pipelined one on the instance. Capturing through that would capture
the pipeline and recurse into it. ``forward`` may also assign attributes (``self.src_mask = ...``);
torch.export would leave fake tensors there and concrete capture the example's values, so both
are put back. Capture and its checks also run forward for real: buffer updates and random draws
are undone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from ..device import rng_forked

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def own_forward(module: nn.Module) -> Iterator[None]:
    """Run the module's class ``forward`` inside this block."""
    installed = vars(module).pop("forward", None)
    try:
        yield
    finally:
        if installed is not None:
            module.forward = installed



def training_flags(module: nn.Module) -> tuple[bool, ...]:
    """The ``training`` flag of ``module`` and every submodule, in ``module.modules()`` order: what
    a captured graph's mode depends on."""
    return tuple(m.training for m in module.modules())


@contextlib.contextmanager
def training_flags_set(module: nn.Module, flags: tuple[bool, ...] | bool) -> Iterator[None]:
    """``module`` and its submodules in the mode ``flags`` (one flag for all, or one each) inside this
    block, and back in the mode they were in after it."""
    modules = list(module.modules())
    before = [m.training for m in modules]
    wanted = [flags] * len(modules) if isinstance(flags, bool) else list(flags)
    try:
        for m, flag in zip(modules, wanted):
            m.training = flag
        yield
    finally:
        for m, flag in zip(modules, before):
            m.training = flag


@contextlib.contextmanager
def planned_in_training(module: nn.Module) -> Iterator[None]:
    """Plans are made for training: a module entirely in eval mode (a validation batch arrived
    first) is captured and profiled as after ``module.train()`` inside this block."""
    if any(training_flags(module)):
        yield
        return
    with training_flags_set(module, True):
        yield


@contextlib.contextmanager
def attributes_restored(module: nn.Module) -> Iterator[None]:
    """Undo the plain attributes and buffer replacements that ``forward`` makes on any submodule
    inside this block (values changed in place are :func:`side_effects_undone`'s business)."""
    before = {m: (plain_attributes(m), dict(m._buffers)) for m in module.modules()}
    try:
        yield
    finally:
        for m, (attributes, buffers) in before.items():
            for key in set(plain_attributes(m)) - set(attributes):
                delattr(m, key)
            for key, value in attributes.items():
                if m.__dict__.get(key, value) is not value:
                    object.__setattr__(m, key, value)
            for key in set(m._buffers) - set(buffers):
                del m._buffers[key]
            m._buffers.update(buffers)


def plain_attributes(module: nn.Module) -> dict[str, Any]:
    """The instance attributes of ``module`` other than its parameters, buffers and children."""
    return {k: v for k, v in vars(module).items() if k not in ("_parameters", "_buffers", "_modules")}


@contextlib.contextmanager
def side_effects_undone(module: nn.Module) -> Iterator[None]:
    """Restore the buffers that running ``module`` inside this block updates, and the RNG it draws from."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    with rng_forked(list(buffers.values()) + list(module.parameters())):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        # through .data: putting values back must not count as a change for the
                        # backward of a step that saved the buffer before (BatchNorm's running stats)
                        b.data.copy_(buffers[name])


def keeps_random_state(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with its random draws (the profiler's random gradients, calibration's dropout) not
    advancing the caller's generators: the CPU one and those of CUDA devices already in use."""

    @functools.wraps(fn)
    def kept(*args: P.args, **kwargs: P.kwargs) -> R:
        with rng_forked():
            return fn(*args, **kwargs)

    return kept


@contextlib.contextmanager
def buffers_restored(state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Put back the values of the non-parameter tensors of ``state`` on leaving this block."""
    saved = {k: v.detach().clone() for k, v in state.items() if not isinstance(v, nn.Parameter)}
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in saved.items():
                state[k].data.copy_(v)  # not a change for a backward that saved it (see side_effects_undone)
