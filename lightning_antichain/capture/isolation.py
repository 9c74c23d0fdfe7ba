"""Capture leaves the user's module as it found it.

Capture records the user's ``forward``, so it must run the class's own ``forward`` even while the
strategy has installed the pipelined one on the instance. Capturing through that would capture
the pipeline and recurse into it. ``forward`` may also assign attributes (``self.src_mask = ...``);
torch.export would leave fake tensors there and concrete capture the example's values, so both
are put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


@contextlib.contextmanager
def own_forward(module: nn.Module) -> Iterator[None]:
    """Run the module's class ``forward`` inside this block."""
    installed = vars(module).pop("forward", None)
    try:
        yield
    finally:
        if installed is not None:
            module.forward = installed




@contextlib.contextmanager
def attributes_restored(module: nn.Module) -> Iterator[None]:
    """Undo the plain attributes that ``forward`` assigns on any submodule inside this block."""
    before = {m: _plain_attributes(m) for m in module.modules()}
    try:
        yield
    finally:
        for m, attributes in before.items():
            for key in set(_plain_attributes(m)) - set(attributes):
                delattr(m, key)
            for key, value in attributes.items():
                if m.__dict__.get(key, value) is not value:
                    object.__setattr__(m, key, value)


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k not in ("_parameters", "_buffers", "_modules")}
