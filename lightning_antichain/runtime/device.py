"""The one device layer: everything that differs between the CPU and an accelerator.

After torchgpipe's ``stream.py``, every other module asks this one and none branches on the device
type. It owns streams and events (a stage's copy stream, the current compute stream, waiting and
``record_stream``), synchronisation, the per-device random generators, device memory, autocast
and the device's name. It imports nothing else of the package, so every layer may use it.

CPU devices have no streams: a copy is a plain ``.to``, waiting is nothing, and every CPU device
shares one machine's cores and memory (:func:`shares_host`), which the planner and calibration
account for.

Moving values between stages: on CUDA the sending stage issues the copy on its own copy stream,
after that stream has waited for the compute that produced the values, and hands the receiver an
event; the receiver's compute stream waits for that event and nothing else. So a copy overlaps the
sender's next micro-batch and the receiver's current one, and the caching allocator is told which
streams use each tensor (``record_stream``) so no memory is reused while a copy is in flight.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

Device = str | torch.device

#: the device kinds autocast can be on; a worker thread re-enters its caller's settings for each
AUTOCAST_KINDS = ("cpu", "cuda")


def as_device(device: Device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def is_accelerator(device: Device) -> bool:
    """Whether ``device`` is a CUDA device (streams, its own memory, a fast link to the others)."""
    return as_device(device).type == "cuda"


def shares_host(device: Device) -> bool:
    """Whether ``device`` is the CPU: its stages share one machine's cores, memory and allocator.

    A plan's stage may name a device torch does not know (a planner's ``DeviceSpec("fast")``): it
    is taken to be a device of its own."""
    try:
        return as_device(device).type == "cpu"
    except RuntimeError:
        return False


def same_device(a: Device, b: Device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the index meant."""
    a, b = as_device(a), as_device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def device_name(device: Device) -> str:
    """What the device is, for cache keys and reports: the GPU's model, else the CPU's."""
    device = as_device(device)
    if is_accelerator(device):
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def memory_gb(device: Device, usable: float = 0.9) -> float | None:
    """Usable memory of an accelerator in GB (``usable`` of its total); ``None`` (unlimited) on the CPU."""
    device = as_device(device)
    if not is_accelerator(device):
        return None
    return usable * torch.cuda.get_device_properties(device).total_memory / 1e9


# Synchronisation, streams and events


def synchronize(devices: Device | Iterable[Device]) -> None:
    """Wait until the queued work of each accelerator in ``devices`` is done (the CPU's always is)."""
    for device in [devices] if isinstance(devices, (str, torch.device)) else devices:
        if is_accelerator(device):
            torch.cuda.synchronize(as_device(device))


def use_device(device: Device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for this thread (CUDA keeps a current device per thread)."""
    device = as_device(device)
    return torch.cuda.device(device) if is_accelerator(device) else contextlib.nullcontext()


def new_copy_stream(device: Device) -> Any:
    """A stream of its own for a stage's outgoing copies on an accelerator; ``None`` on the CPU."""
    device = as_device(device)
    return torch.cuda.Stream(device) if is_accelerator(device) else None


def ship(
    values: Sequence[Any], source: torch.device, target: torch.device, copy_stream: Any
) -> tuple[tuple[Any, ...], Any]:
    """Detached copies of ``values`` on ``target`` and the event to wait for (``None``: ready now)."""
    detached = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
    if copy_stream is None or not is_accelerator(target):
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


# Random number generators


def has_generator(device: Device) -> bool:
    """Whether ``device`` has generators this package can seed and fork."""
    return as_device(device).type in ("cpu", "cuda")


def default_generator(device: Device) -> torch.Generator:
    """The generator ``torch.manual_seed`` seeds and unseeded random ops on ``device`` draw from."""
    device = as_device(device)
    if is_accelerator(device):
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


@contextlib.contextmanager
def rng_forked(example: Any = None) -> Iterator[None]:
    """Random draws made inside this block do not advance the user's generators: the CPU's, and
    those of the accelerators holding a tensor of ``example`` (with no ``example``: of every
    accelerator already in use)."""
    if example is None:
        indices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    else:
        indices = sorted({t.device.index or 0 for t in pytree.tree_leaves(example)
                          if isinstance(t, torch.Tensor) and is_accelerator(t.device)})
    with torch.random.fork_rng(devices=indices):
        yield


# Autocast


def autocast_settings() -> list[tuple[str, torch.dtype]]:
    """The calling thread's autocast: each device kind it is on for, with its dtype."""
    return [(kind, torch.get_autocast_dtype(kind)) for kind in AUTOCAST_KINDS if torch.is_autocast_enabled(kind)]


def autocast_managers(settings: Sequence[tuple[str, torch.dtype]]) -> list[Any]:
    """Context managers that enter the autocast ``settings`` (device kind, dtype) exactly, turning
    off the kinds not listed (a recomputed forward runs inside backward, which is outside autocast
    when Lightning runs it, and must see the forward's settings)."""
    enabled = dict(settings)
    return [torch.autocast(kind, dtype=enabled[kind]) if kind in enabled else torch.autocast(kind, enabled=False)
            for kind in AUTOCAST_KINDS if kind in enabled or torch.is_autocast_enabled(kind)]


def forget_autocast_casts() -> None:
    """Drop this thread's cached autocast casts of the weights. A cast made under ``no_grad`` (a
    forward that will be recomputed) has no autograd history; before torch fixed its cache, a later
    forward with gradients in the same autocast region reused it, and its weights got no gradient."""
    torch.clear_autocast_cache()
