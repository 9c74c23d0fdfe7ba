"""Memory facts the planner needs from the running program: device capacity and optimizer state size."""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Optimizer state tensors per parameter, each the parameter's size, for torch's own optimizers.
_STATE_PER_PARAMETER = {
    "SGD": lambda group: 1.0 if group.get("momentum", 0) else 0.0,
    "Adam": lambda group: 3.0 if group.get("amsgrad") else 2.0,
    "AdamW": lambda group: 3.0 if group.get("amsgrad") else 2.0,
    "Adamax": lambda group: 2.0,
    "NAdam": lambda group: 2.0,
    "RAdam": lambda group: 2.0,
    "Adagrad": lambda group: 1.0,
    "Adadelta": lambda group: 2.0,
    "RMSprop": lambda group: 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered")),
    "ASGD": lambda group: 1.0,
    "Rprop": lambda group: 2.0,
}
UNKNOWN_OPTIMIZER_MULTIPLIER = 2.0


def optimizer_multiplier(optimizers: Iterable[torch.optim.Optimizer]) -> float:
    """Optimizer state bytes per parameter byte, the largest over the given optimizers' groups.

    Known torch optimizers are read from their class and settings (Adam: 2, SGD with momentum: 1,
    plain SGD: 0); anything else counts as 2, Adam's size, to stay on the safe side.
    """
    found = [0.0]
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        rule = _STATE_PER_PARAMETER.get(type(optimizer).__name__)
        for group in optimizer.param_groups:
            found.append(rule(group) if rule else UNKNOWN_OPTIMIZER_MULTIPLIER)
    return max(found)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of the optimizer's per-parameter state tensors (those shaped like their parameter)."""
    total = 0
    for param in parameters:
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                total += value.numel() * value.element_size()
    return total
