"""Give a model built on the meta device real storage, one module at a time, where it is needed.

A model built under ``torch.device("meta")`` (or Lightning's ``empty_init=True``) has the shapes of
its parameters but no memory. The pipeline makes each stage real on the stage's own device, and the
profiler makes each operation's modules real just long enough to time it, so that no device ever
holds the whole model. Both follow Lightning's contract (``fabric/utilities/init.py``): a module
with meta tensors of its own initialises them with its ``reset_parameters()``.

Tensors are swapped in place (``torch.utils.swap_tensors``) instead of replaced as
``Module.to_empty`` does: an optimizer made on the meta model, and every stage that fetches a
parameter, keep the same objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import nn

Init = Literal["reset", "random"]

_WAITING: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
"""Values that meta tensors take when they are made real (:func:`load_state_dict`), by ``id``
(tensors compare by value, so they cannot be dictionary keys)."""


def _wait(tensor: torch.Tensor, value: torch.Tensor) -> None:
    key = id(tensor)
    _WAITING[key] = (weakref.ref(tensor, lambda _: _WAITING.pop(key, None)), value)


def _is_waiting(tensor: torch.Tensor) -> bool:
    entry = _WAITING.get(id(tensor))
    return entry is not None and entry[0]() is tensor


def _take(tensor: torch.Tensor) -> torch.Tensor:
    return _WAITING.pop(id(tensor))[1]


def load_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """``module.load_state_dict(state_dict)`` for a module that may be on the meta device.

    Real tensors are loaded now. Each meta tensor keeps its value waiting, and takes it when it is
    made real on its stage's device (:func:`materialize`) instead of its module's
    ``reset_parameters()``: so a checkpoint goes straight into the stages, one tensor at a time,
    never into a whole model first. Load the file with ``torch.load(path, mmap=True)`` and its
    values stay on disk until then. ``strict`` refuses missing and unexpected keys, as torch does.
    """
    own = module.state_dict(keep_vars=True)
    if strict:
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                               f"{missing[:5]}, unexpected keys {unexpected[:5]}")
    real = {k: v for k, v in state_dict.items() if k in own and not own[k].is_meta}
    for key, value in state_dict.items():
        tensor = own.get(key)
        if tensor is not None and tensor.is_meta:
            if tuple(value.shape) != tuple(tensor.shape):
                raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                   f"the shape in the current model is {tuple(tensor.shape)}")
            _wait(tensor, value)
    module.load_state_dict(real, strict=False)


def has_meta_state(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def meta_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters and buffers on the meta device."""
    return [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]


def meta_attributes(module: nn.Module) -> list[str]:
    """Names of the tensors on the meta device that ``module`` and its children hold as plain
    attributes, not as parameters or buffers (a torchmetrics metric's states): nothing knows how to
    make them real."""
    found = []
    for name, sub in module.named_modules():
        for attribute, value in vars(sub).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if attribute not in ("_parameters", "_buffers") and any(
                    isinstance(v, torch.Tensor) and v.is_meta for v in values):
                found.append(f"{name}.{attribute}" if name else attribute)
    return found


def own_state(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` holds itself (not its children's)."""
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def materialize(modules: Iterable[nn.Module], device: torch.device, init: Init = "reset",
                names: dict[int, str] | None = None) -> list[nn.Module]:
    """Give the meta tensors each of ``modules`` holds itself storage on ``device``; returns the
    modules that had any.

    ``init="reset"`` initialises each such module with its ``reset_parameters()`` and refuses, by
    name (from ``names``, by ``id``), a module that has none. ``init="random"`` fills the new tensors
    with values of the right kind for timing (small normal floats, zero integers) and calls
    ``reset_parameters()`` only where a module has one, for the values that shape a computation
    (a mask, a table of positions) where it rebuilds them.
    """
    made = []
    for module in modules:
        meta = [t for t in own_state(module) if t.is_meta]
        if not meta:
            continue
        if init == "reset" and all(_is_waiting(t) for t in meta):  # loaded: no initialisation needed
            for tensor in meta:
                value = _take(tensor)
                _swap(tensor, value.detach().to(device=device, dtype=tensor.dtype, copy=True))
            made.append(module)
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset) and init == "reset":
            name = (names or {}).get(id(module), type(module).__name__)
            raise TypeError(
                f"{name} ({type(module).__name__}) has parameters or buffers on the meta device but no "
                f"reset_parameters() to initialise them on {device}: give {type(module).__name__} a "
                "reset_parameters() method, load a checkpoint into the model, or build it with real tensors"
            )
        for tensor in meta:
            real = torch.empty_like(tensor, device=device)
            if init == "random":
                _fill_for_timing(real)
            _swap(tensor, real)
        if callable(reset):
            with torch.no_grad():
                reset()
        if init == "reset":  # values loaded for some of its tensors win over the reset
            with torch.no_grad():
                for tensor in meta:
                    if _is_waiting(tensor):
                        tensor.copy_(_take(tensor))
        made.append(module)
    return made


def release(modules: Iterable[nn.Module]) -> None:
    """Send the tensors each of ``modules`` holds itself back to the meta device, freeing their memory."""
    for module in modules:
        for tensor in own_state(module):
            if not tensor.is_meta:
                tensor.grad = None
                _swap(tensor, torch.empty_like(tensor, device="meta"))


def _swap(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``tensor`` hold ``value`` without replacing the object (a Parameter stays a Parameter)."""
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, tensor.requires_grad)
    torch.utils.swap_tensors(tensor, value)


def _fill_for_timing(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.normal_(0.0, 0.02)
        else:
            tensor.zero_()
