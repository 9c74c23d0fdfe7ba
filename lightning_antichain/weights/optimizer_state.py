"""Optimizer state lives with its parameter, on that parameter's stage device.

Lightning moves all optimizer state to the root device after setup and after loading a
checkpoint; with stages on several devices that would put every stage's state on the first one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def state_with_parameters(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Move each optimizer state tensor to its parameter's device (a ``step`` count stays where it is)."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(param.device)



def with_replaced_parameters(optimizers: Iterable[torch.optim.Optimizer], replaced: dict[int, nn.Parameter]) -> None:
    """Make each optimizer step the parameters that replaced its own (``replaced``, by the id of
    the one replaced: FSDP2's shards), with the state it holds for them."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                new = replaced.get(id(param))
                if new is not None:
                    group["params"][i] = new
                    if param in optimizer.state:
                        optimizer.state[new] = optimizer.state.pop(param)


def state_sharded_like_parameters(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Shard each whole state tensor of a sharded parameter (a ``DTensor``: FSDP2's) as the
    parameter is (a checkpoint's state, loaded whole). Every rank of the parameter's mesh calls it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    state[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
