"""Optimizer state lives with its parameter, on that parameter's stage device.

Lightning moves all optimizer state to the root device after setup and after loading a
checkpoint; with stages on several devices that would put every stage's state on the first one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def state_with_parameters(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Move each optimizer state tensor to its parameter's device (a ``step`` count stays where it is)."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(param.device)
