"""The roofline's efficiencies fitted to a GPU's measured times.

The target cost model (:mod:`.roofline`) prices each kernel at a share of the GPU's published peak
that its kind reaches (:class:`~.roofline.Efficiencies`). Those shares are assumed until someone
with the GPU times operations on it: this fits them to such timings. Each timed operation comes
with the kernels the roofline counted for it on meta tensors and the ATen calls its host issued,
so it can be priced again at any efficiencies; the fit moves each kind's share (of the dense peak
for matrix products and attention, of the memory bandwidth for the rest) until the operations
that kind dominates (at the starting shares) are predicted, on the geometric mean, at their
measured times, and the host's time per call from the operations the host paces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .roofline import KINDS, Efficiencies, Kernel
from .target_devices import TargetDevice

#: the kinds whose kernels are priced by their FLOPs at their best (the others by their bytes)
COMPUTE_KINDS = ("matmul", "attention")
#: an operation is a kind's to fit when that kind takes at least this share of its GPU time
DOMINANT = 0.6
ROUNDS = 8


@dataclass(frozen=True)
class TimedOperation:
    """An operation measured on a GPU: what the roofline counted for it (``kernels``, ``dispatches``
    ATen calls) and its ``measured_s``."""

    name: str
    kernels: tuple[Kernel, ...]
    dispatches: int
    measured_s: float

    def gpu_s(self, device: TargetDevice, efficiencies: Efficiencies) -> float:
        return sum(k.seconds(device, efficiencies) for k in self.kernels)

    def predicted_s(self, device: TargetDevice, efficiencies: Efficiencies) -> float:
        """As :class:`~.roofline.Tally` predicts it: the GPU's time or the host's, the longer."""
        return max(self.gpu_s(device, efficiencies), self.dispatches * efficiencies.dispatch_s)

    def dominant_kind(self, device: TargetDevice, efficiencies: Efficiencies) -> str | None:
        """The kind of kernel taking at least :data:`DOMINANT` of its GPU time, or ``"host"``
        where the host's dispatch is the longer; ``None`` where no kind dominates."""
        if self.dispatches * efficiencies.dispatch_s > self.gpu_s(device, efficiencies):
            return "host"
        by_kind = {kind: 0.0 for kind in KINDS}
        for kernel in self.kernels:
            by_kind[kernel.kind] += kernel.seconds(device, efficiencies)
        kind, seconds = max(by_kind.items(), key=lambda item: item[1])
        total = sum(by_kind.values())
        return kind if total > 0 and seconds >= DOMINANT * total else None


def fit_efficiencies(operations: Sequence[TimedOperation], device: TargetDevice, source: str,
                     start: Efficiencies | None = None) -> Efficiencies:
    """``start`` (default: the assumed efficiencies) with each kind's share, and the host's time
    per call, moved to predict the operations it dominates at their measured times (the geometric
    mean of predicted over measured brought to 1). A kind no operation is dominated by keeps its
    share. ``source`` says where the timings came from."""
    fitted = start or Efficiencies()
    # which kind each operation fits is decided once, at the starting shares: decided again each
    # round, a host time fitted long (a CPU's, in a dry run) would claim every operation
    kinds = [op.dominant_kind(device, fitted) if op.measured_s > 0 and op.kernels else None for op in operations]
    for _ in range(ROUNDS):
        groups: dict[str, list[float]] = {}
        for op, kind in zip(operations, kinds, strict=True):
            if kind is not None:
                groups.setdefault(kind, []).append(math.log(op.predicted_s(device, fitted) / op.measured_s))
        compute, memory, dispatch_s = dict(fitted.compute), dict(fitted.memory), fitted.dispatch_s
        for kind, logs in groups.items():
            ratio = math.exp(sum(logs) / len(logs))  # predicted over measured: a share that much too small
            if kind == "host":
                dispatch_s = dispatch_s / ratio
            elif kind in COMPUTE_KINDS:
                compute[kind] = min(1.0, compute[kind] * ratio)
            else:
                memory[kind] = min(1.0, memory[kind] * ratio)
        fitted = dataclasses.replace(fitted, compute=compute, memory=memory, dispatch_s=dispatch_s, source=source)
    return fitted
