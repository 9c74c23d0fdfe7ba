"""The LightningModule's (or a submodule's) forward replaced by the pipelined one, and put back.

For the strategy's whole lifetime, not just inside the steps: Lightning's model summary, user hooks
and ``predict`` also call the module, and with stages on several devices a plain forward would mix
devices. An instance attribute wins over the class's method, so removing it restores the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class ForwardPatch:
    """At most one module at a time has its forward replaced."""

    def __init__(self) -> None:
        self.module: nn.Module | None = None

    def install(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.uninstall()
        module.forward = forward
        self.module = module

    def uninstall(self) -> None:
        if self.module is not None:
            vars(self.module).pop("forward", None)
            self.module = None
