"""A device-memory counter for tests: live bytes per device, and their peak.

Every tensor an ATen operation creates while the mode is active is counted once per storage (views
share it) until its storage is freed; tensors that exist when it starts are counted with
:meth:`LiveBytes.include`. Meta tensors hold no memory and are not counted. The CPU's "devices"
share one RAM, so a test that asks where a model's bytes were at most uses the peak on ``cpu``.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Counts live bytes by device while active (``with LiveBytes() as live:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self._counted: set[int] = set()

    def include(self, tensors: Iterable[torch.Tensor]) -> LiveBytes:
        """Count tensors made before the mode started (a model's parameters, say)."""
        for tensor in tensors:
            self._count(tensor)
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._count(value)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._counted:
            return
        device, nbytes = str(tensor.device), storage.nbytes()
        self._counted.add(key)
        self.live[device] += nbytes
        self.peak[device] = max(self.peak[device], self.live[device])
        weakref.finalize(storage, self._freed, key, device, nbytes)

    def _freed(self, key: int, device: str, nbytes: int) -> None:
        self._counted.discard(key)
        self.live[device] -= nbytes
