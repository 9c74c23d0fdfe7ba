"""Parameters used by stages on different devices, in one process: a leaf per device, one gradient.

A weight tied across the pipeline (GPT-2's, Gemma's and Llama 3.2's input embedding is also the
output layer's weight) is read by the first stage and by the last, on two devices. As Megatron's
embedding group and DeepSpeed's ``TiedLayerSpec`` do across processes, each device here holds its
own leaf of the parameter: on the parameter's own device a leaf sharing its storage (no copy),
on every other device a copy. Every gradient a leaf receives is added to the parameter's own
``.grad`` as soon as autograd has accumulated it, under one lock, so the optimizer, clipping and
gradient accumulation see one parameter with the gradient plain training gives it. The copies take
the parameter's values again whenever its version changes (an optimizer step, a loaded checkpoint),
checked before every forward, so they can never run stale.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable

import torch
from torch import nn

from ..device import StageStreams, add_gradient


class TiedCopies:
    """Each tied parameter's leaf on each device that uses it, kept equal and summing gradients."""

    def __init__(self) -> None:
        self._leaves: dict[tuple[int, Hashable], nn.Parameter] = {}
        self._parameters: dict[int, nn.Parameter] = {}
        self._synced: dict[int, tuple[int, int]] = {}  # each parameter's storage and version at the last copy
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parameters)

    def parameters(self) -> list[nn.Parameter]:
        """The tied parameters themselves (which no stage reads directly any more)."""
        return list(self._parameters.values())

    def leaf(self, param: nn.Parameter, slot: Hashable, device: torch.device, home: StageStreams,
             at_home: bool) -> nn.Parameter:
        """``param``'s leaf on device ``slot`` (made on ``device`` the first time): sharing its
        storage where it is ``at_home`` (on the device of the ``home`` stage, where the parameter
        lives and its gradient is summed), a copy elsewhere, even where the torch device is the
        same (CPU devices stand for separate ones, and behave as they would)."""
        key = (id(param), slot)
        found = self._leaves.get(key)
        if found is not None:
            return found
        with torch.no_grad():
            value = param.detach() if at_home else param.detach().to(device, copy=True)
        leaf = nn.Parameter(value, requires_grad=param.requires_grad)
        if param.requires_grad:
            leaf.register_post_accumulate_grad_hook(self._give_to(param, home))
        self._leaves[key] = leaf
        self._parameters[id(param)] = param
        self._synced[id(param)] = _token(param)
        return leaf

    def refresh(self) -> None:
        """Copy each parameter whose values changed since the last look (or that moved) into its
        leaves that do not share its storage."""
        for (i, _), leaf in self._leaves.items():
            param = self._parameters[i]
            if self._synced[i] != _token(param) and leaf.data_ptr() != param.data_ptr():
                with torch.no_grad():
                    leaf.copy_(param)
        self._synced = {i: _token(p) for i, p in self._parameters.items()}

    def leaves(self) -> list[nn.Parameter]:
        return list(self._leaves.values())

    def _give_to(self, param: nn.Parameter, home: StageStreams) -> Callable[[torch.Tensor], None]:
        def give(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            if grad is not None:
                with self._lock:
                    param.grad = add_gradient(param.grad, grad, home)
        return give


def _token(param: torch.Tensor) -> tuple[int, int]:
    return param.data_ptr(), param._version


def module_with_leaves(module: nn.Module, leaves: dict[int, nn.Parameter]) -> nn.Module:
    """A copy of ``module`` in which each parameter keyed in ``leaves`` (by id) is replaced by its
    leaf, and every other parameter, buffer and submodule state is the original object."""
    memo: dict[int, object] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        memo[id(tensor)] = leaves.get(id(tensor), tensor)
    return copy.deepcopy(module, memo)
