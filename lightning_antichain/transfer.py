"""Move values between stage devices without stalling the stages.

On CUDA the sending stage issues the copy on its own copy stream, after that stream has waited for
the compute that produced the values, and hands the receiver an event; the receiver's compute
stream waits for that event and nothing else. So a copy overlaps the sender's next micro-batch and
the receiver's current one, and the caching allocator is told which streams use each tensor
(``record_stream``) so no memory is reused while a copy is in flight. Between CPU devices, and to
or from the CPU, a copy is a plain (blocking or no-op) ``.to``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def copy_stream_for(device: torch.device) -> Any:
    """A dedicated copy stream on a CUDA device; ``None`` elsewhere."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def ship(
    values: Sequence[Any], source: torch.device, target: torch.device, copy_stream: Any
) -> tuple[tuple[Any, ...], Any]:
    """Detached copies of ``values`` on ``target`` and the event to wait for (``None``: ready now)."""
    detached = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
    if copy_stream is None or target.type != "cuda":
        return tuple(v.to(target) if isinstance(v, torch.Tensor) else v for v in detached), None
    compute = torch.cuda.current_stream(source)
    copy_stream.wait_stream(compute)
    with torch.cuda.stream(copy_stream):
        moved = []
        for v in detached:
            if isinstance(v, torch.Tensor):
                v.record_stream(copy_stream)
                v = v.to(target, non_blocking=True)
            moved.append(v)
        event = torch.cuda.Event()
        event.record(copy_stream)
    return tuple(moved), event


def arrive(values: Sequence[Any], event: Any, device: torch.device, grad_flags: Sequence[bool]) -> tuple[Any, ...]:
    """The shipped values made ready for the stage on ``device``; flagged tensors become gradient leaves.

    Values that were not shipped (a micro-batch straight from the caller) are moved here.
    """
    if event is not None:
        compute = torch.cuda.current_stream(device)
        compute.wait_event(event)
        for v in values:
            if isinstance(v, torch.Tensor):
                v.record_stream(compute)
    ready = [v.detach().to(device) if isinstance(v, torch.Tensor) else v for v in values]
    return tuple(
        v.requires_grad_(True) if flag and isinstance(v, torch.Tensor) else v for v, flag in zip(ready, grad_flags)
    )
